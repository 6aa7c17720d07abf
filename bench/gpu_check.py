"""The GPU check: everything a GPU decides about the engine, in one run that writes one JSON.

    bench/gpu_check.sh [gpu_check.json]            # on a CUDA machine, under 8 minutes on one H200
    python -m bench.gpu_check --dry-run out.json   # the same parts on CPU with tiny shapes: the wiring only

Parts, each timed and each allowed to fail without stopping the rest (its error is recorded instead); the JSON
is rewritten after every part, so a run cut short still leaves what it measured:

1. `kernels`: `bench.gpu_kernels` (quick shapes): every Triton kernel against its reference, and timings.
2. `engine_vs_hf`: our engine against transformers on Qwen3-0.6B's shapes in bf16 (random weights):
   `generate` in static batches of 16 on a mixed-length workload (target >= 10x), and `generate_batch`
   (transformers' continuous batching, paged attention) on a uniform one (target >= 1.5x).
3. `decode_floor`: decode ms/token at batch 1 for Qwen3-8B and -32B shapes (random bf16 weights built in
   memory), against the floor that the measured copy bandwidth sets: weight bytes / bandwidth (target <= 1.5x).
4. `step_overhead`: `bench.step_overhead` with its stub's tensors and the sampling on the GPU: the host's
   work per step at 256 decoding sequences (target <= 1 ms), which the forward does not overlap.
5. `mixed`: `bench.mixed` on the GPU (fewer requests): an urgent chat's latency under a bulk backlog.
6. `graphs_identity`: greedy tokens with CUDA graphs on and off, 0.6B shapes, bf16: identical, token for token,
   with arrivals staggered so that mixed steps replay piece graphs and decode steps whole-step graphs.
7. `memory`: a pool that starts small and grows under load with `kv_cache_memory` 0.9: the peak allocated
   memory against weights + KV budget + the activations the profiling step held back + the graphs' memory,
   and the device.
8. `fp8`: `bench.fp8` (an FP8 checkpoint's weight bytes and tokens/s beside its dequantized twin), dense and
   Qwen3-MoE (`tiny-moe-blocks`, whose FP8 experts also replay in CUDA graphs: `moe_graphs`, as
   `graphs_identity`), and decode ms/token at batch 1 of Qwen3-8B's shapes with bf16 and with FP8 weights
   (random, quantized on the device): FP8 halves the bytes each step reads (target: >= 1.4x faster). The FP8
   kernels' checks and timings are in `kernels`.
9. `moe_graphs`: `graphs_identity` on the `tiny-moe` checkpoint (Qwen3-MoE), whose expert kernels run inside
   the piece and decode graphs whatever the routing of the step they replay.
10. `speculative`: `bench.speculative`'s `copy` workload on the GPU (the model built to quote its prompt,
   `bench.copy_model`, in `.convoq/models/copy-tiny`; built first where it is missing, in seconds): decode
   tokens/s with and without drafts at batch 1 and 16 (targets >= 1.8x and >= 1.3x), whether the greedy outputs
   are the same (reported: in bf16 a verify step's kernels may round otherwise than a decode step's), the
   acceptance rate and mean accepted length.

The last line printed is a JSON summary: each part's verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench import engine_vs_hf, gpu_e2e, gpu_kernels, mixed, speculative, step_overhead
from bench import fp8 as bench_fp8
from bench.common import tiny_model
from bench.copy_model import copy_model
from cli.tiny_model import FP8_QUANTIZATION
from engine.config import EngineConfig, model_dtype
from engine.hf_backend import HFEngine
from engine.interface import Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.cuda_graphs import PieceGraphs
from engine.model.fp8 import quantize_checkpoint

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                vocab_size=151936, rope_theta=1000000.0)
# stands in for both large shapes in a dry run: the same code path, a model that builds in milliseconds
DRY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                 vocab_size=4096, rope_theta=1000000.0)
TARGETS = {"vs_generate": 10.0, "vs_generate_batch": 1.5, "decode_vs_floor": 1.5, "host_ms_per_step": 1.0,
           "fp8_decode_speedup": 1.4}


class Check:
    """Where the check runs: a GPU in earnest, or the CPU with tiny shapes (`dry`)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.dtype = "float32" if dry else "bfloat16"
        self.preset = "tiny" if dry else "0.6b"

    def synchronize(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def release(self) -> None:
        if not self.dry:
            torch.cuda.empty_cache()


def kernels(check: Check) -> dict:
    if check.dry:
        return {"skipped": "needs CUDA (the kernel tests run the same checks under TRITON_INTERPRET=1)"}
    report = gpu_kernels.run(quick=True)
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _generate_batch_tok_s(path: Path, check: Check, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' continuous batching (`generate_batch`, paged attention) on `prompts`, greedy."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(check.dtype, check.device),
                                                 attn_implementation="paged|sdpa").to(check.device).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=config)  # warm-up
    start = time.monotonic()
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    check.synchronize()
    seconds = time.monotonic() - start
    return sum(len(o.generated_tokens) for o in outputs.values()) / seconds


def engine_vs_transformers(check: Check) -> dict:
    path = tiny_model(check.preset)
    engine = LLMEngine(EngineConfig(model=str(path), device=check.device, dtype=check.dtype))
    vocab = len(engine.tokenizer)
    count = 4 if check.dry else None  # the whole workload on a GPU
    ours = engine_vs_hf.measure(engine, check.preset, vocab, 0, "engine", 1, count)
    uniform = [r.prompt_ids for r in engine_vs_hf.make_requests(check.preset, vocab, 7, "u", count)]
    new_tokens = 8 if check.dry else 128
    requests = [Request(f"u{i}", p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
                for i, p in enumerate(uniform)]
    tokens, seconds = engine_vs_hf.drain(engine, requests, "engine uniform")
    ours_uniform = tokens / seconds
    del engine
    check.release()
    hf = HFEngine(str(path), device=check.device, dtype=check.dtype, max_batch_size=16)
    generate = engine_vs_hf.measure(hf, check.preset, vocab, 0, "hf", 1, count)
    del hf
    check.release()
    batched = _generate_batch_tok_s(path, check, uniform, new_tokens)
    check.release()
    return {
        "model": check.preset, "dtype": check.dtype,
        "engine_tok_s": ours, "generate_tok_s": generate, "vs_generate": ours / generate,
        "engine_uniform_tok_s": ours_uniform, "generate_batch_tok_s": batched,
        "vs_generate_batch": ours_uniform / batched,
        "ok": None if check.dry else (ours / generate >= TARGETS["vs_generate"]
                                      and ours_uniform / batched >= TARGETS["vs_generate_batch"]),
    }


def _decode_ms_per_token(shape: dict, check: Check, bandwidth_gbs: float | None, fp8: bool = False) -> dict:
    """`fp8`: the projections quantized to FP8 blocks as they are drawn, the config saying so."""
    with tempfile.TemporaryDirectory() as folder:
        gpu_e2e.write_config(Path(folder), shape)
        weights = gpu_e2e.random_weights(torch.Generator(check.device).manual_seed(0), shape, check.device)
        if fp8:
            config = json.loads((Path(folder) / "config.json").read_text())
            (Path(folder) / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_QUANTIZATION}))
            weights = quantize_checkpoint(weights, [0] * shape["num_hidden_layers"])  # every layer dense
        engine = LLMEngine(EngineConfig(model=folder, device=check.device, dtype=check.dtype,
                                        initial_blocks=1 << 30, max_num_seqs=8), weights)
    new_tokens = 8 if check.dry else 64
    prompts = gpu_e2e.random_prompts(2, 128, len(engine.tokenizer), seed=5)
    for i, prompt in enumerate(prompts):  # the first compiles and captures: not timed
        run = gpu_e2e.drive(engine, [prompt], new_tokens, f"decode{i}")
    [completion] = run.completions
    ms = completion.timings.decode_ms / (len(completion.token_ids) - 1)
    weight_bytes = engine.memory_report()["weights_bytes"]
    del engine, run
    check.release()
    floor = weight_bytes / (bandwidth_gbs * 1e9) * 1e3 if bandwidth_gbs else None
    return {"weights_bytes": weight_bytes, "ms_per_token": ms, "floor_ms": floor,
            "vs_floor": ms / floor if floor else None}


def decode_floor(check: Check) -> dict:
    bandwidth = None if check.dry else gpu_e2e.copy_bandwidth_gbs()
    shapes = {"8b": DRY_SHAPE, "32b": DRY_SHAPE} if check.dry else {"8b": QWEN3_8B, "32b": gpu_e2e.QWEN3_32B}
    result: dict = {"copy_bandwidth_gbs": bandwidth}
    for name, shape in shapes.items():
        result[name] = _decode_ms_per_token(shape, check, bandwidth)
    ratios = [result[name]["vs_floor"] for name in shapes]
    result["ok"] = None if check.dry else all(r <= TARGETS["decode_vs_floor"] for r in ratios)
    return result


def host_overhead(check: Check) -> dict:
    quick = dict(seqs=32, warmup=8, steps=5) if check.dry else {}
    result = step_overhead.run(tiny_model(), device=check.device, **quick)
    check.release()
    result["ok"] = None if check.dry else result["host_ms_per_step"] <= TARGETS["host_ms_per_step"]
    return result


def mixed_load(check: Check) -> dict:
    if check.dry:
        return mixed.run_engine(chats=2, chat_rate=20.0, bulk=4, repeat=1, seed=0, device=check.device)
    return mixed.run_engine(chats=10, chat_rate=2.0, bulk=128, repeat=1, seed=0, device=check.device)


def _greedy_tokens(path: Path, check: Check, graphs: bool, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy tokens, and how many steps each CUDA graph path ran. Half the prompts come first,
    then one more at every step, so that steps mix prefill chunks with decodes. In a dry run "graphs on" means
    the pieces run as plain calls (`PieceGraphs` on a CPU)."""
    engine = LLMEngine(EngineConfig(model=str(path), device=check.device, dtype=check.dtype, cuda_graphs=graphs,
                                    initial_blocks=1 << 30))
    executor = engine.executor
    if graphs and check.dry:
        executor.pieces = PieceGraphs(engine.model, engine.config.max_num_batched_tokens)
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=32, ignore_eos=True)) for i, p in enumerate(prompts)]
    waiting = requests[len(requests) // 2:]
    for r in requests[:len(requests) // 2]:
        engine.add_request(r)
    done = {}
    while engine.has_unfinished() or waiting:
        if waiting:
            engine.add_request(waiting.pop(0))
        done.update((c.request_id, c.token_ids) for c in engine.step())
    steps = {"steps": engine.stats().steps,
             "decode_graph_steps": executor.graphs.steps if executor.graphs is not None else 0,
             "piece_graph_steps": executor.pieces.steps if executor.pieces is not None else 0}
    del engine, executor
    check.release()
    return [done[r.request_id] for r in requests], steps


def graphs_identity(check: Check, path: Path | None = None) -> dict:
    """On the check's model, or on the checkpoint in `path`."""
    path = path or tiny_model(check.preset)
    prompts = [r.prompt_ids for r in engine_vs_hf.make_requests(check.preset, 4096, 11, "g", 6 if check.dry else 24)]
    with_graphs, steps = _greedy_tokens(path, check, True, prompts)
    without, _ = _greedy_tokens(path, check, False, prompts)
    differing = [i for i, (a, b) in enumerate(zip(with_graphs, without, strict=True)) if a != b]
    # where each differing request first parts ways: late (near-tied logits of random weights) or at once
    first = [next(j for j, (a, b) in enumerate(zip(with_graphs[i], without[i], strict=True)) if a != b)
             for i in differing]
    return {"requests": len(prompts), **steps, "differing_requests": differing, "first_differing_token": first,
            "ok": not differing and steps["piece_graph_steps"] > 0}


def memory(check: Check) -> dict:
    path = tiny_model(check.preset)
    if not check.dry:
        torch.cuda.reset_peak_memory_stats()
    before = 0 if check.dry else torch.cuda.memory_allocated()
    budget = 0.9 if not check.dry else 64 << 20
    engine = LLMEngine(EngineConfig(model=str(path), device=check.device, dtype=check.dtype,
                                    kv_cache_memory=budget, initial_blocks=64, max_num_seqs=512))
    report = engine.memory_report()
    # more K/V than the ceiling holds (on an H200 0.9 of the free memory is ~1M tokens of the 0.6B shapes):
    # the pool grows to its ceiling, then requests are pre-empted
    count, length = (16, 200) if check.dry else (640, 2048)
    prompts = gpu_e2e.random_prompts(count, length, len(engine.tokenizer), seed=9)
    gpu_e2e.drive(engine, prompts, 16, "memory")
    after = engine.memory_report()
    result = {"weights_bytes": report["weights_bytes"], "kv_budget_bytes": report["kv_budget_bytes"],
              "activation_bytes": report["activation_bytes"], "graph_bytes": report["graph_bytes"],
              "pool_bytes_start": report["pool_bytes"], "pool_bytes_end": after["pool_bytes"],
              "pool_blocks_end": after["pool_blocks"], "pool_blocks_max": after["pool_blocks_max"],
              "pool_at_ceiling": after["pool_blocks"] == after["pool_blocks_max"],
              "pool_within_budget": after["pool_bytes"] <= report["kv_budget_bytes"]}
    del engine
    if check.dry:
        result["ok"] = result["pool_within_budget"]
        return result
    peak = torch.cuda.max_memory_allocated() - before
    total = torch.cuda.get_device_properties(0).total_memory
    check.release()
    result.update({"peak_allocated_bytes": peak, "device_bytes": total,
                   # the pool, the weights, what the profiling step held back and the graphs' memory: all the
                   # engine should take
                   "peak_over_planned": peak / (report["weights_bytes"] + report["kv_budget_bytes"]
                                                + report["activation_bytes"] + report["graph_bytes"]),
                   "ok": result["pool_within_budget"] and peak < total})
    return result


def fp8(check: Check) -> dict:
    load = dict(requests=4, new_tokens=4) if check.dry else dict(requests=64, new_tokens=64)
    result = bench_fp8.run("tiny-blocks", check.device, rounds=1, gemm=False, **load)
    moe = bench_fp8.run("tiny-moe-blocks", check.device, rounds=1, gemm=False, **load)
    # the FP8 experts' kernels (the activations quantized on the device) inside the piece and decode graphs
    moe_graphs = graphs_identity(check, Path(bench_fp8.checkpoints("tiny-moe-blocks")[0]))
    bandwidth = None if check.dry else gpu_e2e.copy_bandwidth_gbs()
    shape = DRY_SHAPE if check.dry else QWEN3_8B
    decode = {name: _decode_ms_per_token(shape, check, bandwidth, fp8=name == "fp8") for name in ("bf16", "fp8")}
    speedup = decode["bf16"]["ms_per_token"] / decode["fp8"]["ms_per_token"]
    return {**result, "moe": moe, "moe_graphs": moe_graphs, "decode_8b": decode, "decode_fp8_speedup": speedup,
            "ok": None if check.dry else speedup >= TARGETS["fp8_decode_speedup"] and moe_graphs["ok"]}



def speculative_copy(check: Check) -> dict:
    """Drafts copied from the prompt, on the device; in a dry run the random-weight model stands in (the wiring
    only: it copies nothing)."""
    path = tiny_model() if check.dry else copy_model()
    counts = (2, 4) if check.dry else (8, 32)
    result = {}
    for batch, count in zip(speculative.BATCHES, counts, strict=True):
        requests = speculative.copy_requests(path, count, seed=0)
        result[f"batch_{batch}"] = speculative.compare(path, requests, batch, 1 if check.dry else 2, check.device,
                                                       check.dtype)
        check.release()
    met = all(result[f"batch_{b}"]["speedup"] >= speculative.TARGETS[f"copy_batch_{b}"] for b in speculative.BATCHES)
    result["ok"] = None if check.dry else met
    return result


PARTS: dict[str, Callable[[Check], dict]] = {
    "kernels": kernels, "engine_vs_hf": engine_vs_transformers, "decode_floor": decode_floor,
    "step_overhead": host_overhead, "mixed": mixed_load, "graphs_identity": graphs_identity, "memory": memory,
    "fp8": fp8,
    "moe_graphs": lambda check: graphs_identity(check, tiny_model("tiny-moe")),
    "speculative": speculative_copy,
}


def run(check: Check, out: Path, parts: list[str]) -> dict:
    report: dict = {"device": "cpu (dry run)" if check.dry else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "parts": {}}
    for name in parts:
        start = time.monotonic()
        try:
            result = PARTS[name](check)
        except Exception as exc:  # one part failing must not cost the figures of the others
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:],
                      "ok": False}
            check.release()
        result["seconds"] = round(time.monotonic() - start, 1)
        report["parts"][name] = result
        out.write_text(json.dumps(report, indent=2, default=str))
        print(f"{name}: {'error' if 'error' in result else 'done'} in {result['seconds']} s", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_path", nargs="?", default="gpu_check.json", help="where the report goes")
    parser.add_argument("--dry-run", action="store_true", help="on CPU with tiny shapes: checks the wiring only")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run to check the wiring on CPU", file=sys.stderr)
        return 2
    report = run(Check(args.dry_run), Path(args.json_path), args.parts.split(","))
    summary = {name: part.get("ok") for name, part in report["parts"].items()}
    print(json.dumps({"ok": summary, "json": args.json_path}))
    return 0 if all(ok is not False for ok in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
