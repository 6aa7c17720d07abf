"""End-to-end GPU benchmark of `LLMEngine` on a Qwen3-32B-shaped model (random bf16 weights): decode speed
against the weight-bandwidth floor measured in the same run, and response time for 50 concurrent chat turns.

    python -m bench.gpu_e2e [gpu_e2e.json] [--checkpoint DIR]

The model has Qwen3-32B's shapes (64 layers, hidden 5120, 64 query / 8 KV heads of 128, intermediate 25600,
untied embeddings, vocab 151936), about 65.5 GB of bf16. Its weights are drawn on the GPU tensor by tensor.
By default they are handed to the engine in memory (`LLMEngine(config, weights)`), in place of the
tensors it would read from *.safetensors files: the model is still built, named, fused and checked by the
loader exactly as for a real checkpoint, only the file reads are skipped (writing and reading 65 GB would take
minutes and nearly the whole disk). With `--checkpoint DIR` the weights are written there as sharded
safetensors (reused when complete) and loaded from the files, the path a downloaded checkpoint takes.

Measured, all with the engine's defaults (bf16, attention backend auto = Triton, CUDA graphs on):
1. device-to-device copy bandwidth of a 4 GiB tensor, and the floor it sets: weight bytes / bandwidth is the
   least time a decode step (one token for every running conversation) can take;
2. decode at 1, 8, 32 and 64 concurrent conversations, each a 512-token prompt and 128 generated tokens
   (ignore_eos), all submitted at once: ms per output token per conversation, the mean full-batch decode step,
   and output tokens per second over the run;
3. 50 concurrent chat turns, each a 256-token prompt and a 64-token reply, all submitted at the same instant:
   the response time from submission to the last token (target: mean under 800 ms).
Every workload runs once with other prompts first, so Triton compiling and CUDA graph capture are not timed.

Prints a table last, writes the details as JSON to the given path, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from cli.tiny_model import build_tokenizer
from engine.config import EngineConfig
from engine.interface import Completion, Request, SamplingParams
from engine.llm_engine import LLMEngine

QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                 vocab_size=151936, rope_theta=1000000.0)
SHARD_BYTES = 5 * 10**9
INDEX_FILE = "model.safetensors.index.json"  # written last: its presence marks a complete checkpoint

CONCURRENCIES = (1, 8, 32, 64)
DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS = 512, 128
CHAT_CONVERSATIONS, CHAT_PROMPT_TOKENS, CHAT_REPLY_TOKENS = 50, 256, 64
CHAT_MEAN_RESPONSE_TARGET_MS = 800.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time LLMEngine end to end on a Qwen3-32B-shaped model (CUDA).")
    parser.add_argument("json_path", nargs="?", default="gpu_e2e.json", help="where the details go")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="write (or reuse) the random checkpoint as safetensors shards in this folder and "
                             "load it from the files; needs about 66 GB of disk (default: weights in memory)")
    return parser.parse_args(argv)


def checkpoint_shapes(c: dict = QWEN3_32B) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Qwen3 checkpoint of config `c` (default Qwen3-32B), by name, in file order."""
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            f"{p}input_layernorm.weight": (hidden,),
            f"{p}self_attn.q_proj.weight": (q, hidden),
            f"{p}self_attn.k_proj.weight": (kv, hidden),
            f"{p}self_attn.v_proj.weight": (kv, hidden),
            f"{p}self_attn.q_norm.weight": (head,),
            f"{p}self_attn.k_norm.weight": (head,),
            f"{p}self_attn.o_proj.weight": (hidden, q),
            f"{p}post_attention_layernorm.weight": (hidden,),
            f"{p}mlp.gate_proj.weight": (inter, hidden),
            f"{p}mlp.up_proj.weight": (inter, hidden),
            f"{p}mlp.down_proj.weight": (hidden, inter),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def random_weights(generator: torch.Generator, c: dict = QWEN3_32B,
                   device: str = "cuda") -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, drawn one at a time on `device` in bf16: norms at 1, the rest N(0, 0.02)."""
    for name, shape in checkpoint_shapes(c).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            w = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=generator)
            yield name, w.mul_(0.02)


def write_config(path: Path, c: dict = QWEN3_32B) -> None:
    """config.json and the tokenizer files (cli.tiny_model's tokenizer; the model's vocab is larger, like `0.6b`)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    Qwen3Config(
        **c,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="bfloat16",
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)


def write_shards(path: Path) -> float:
    """Write the random checkpoint as safetensors shards under `path` unless a complete one is there; seconds."""
    if (path / INDEX_FILE).exists():
        return 0.0
    start = time.perf_counter()
    needed = sum(2 * torch.Size(s).numel() for s in checkpoint_shapes().values())
    path.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(path).free < needed * 1.02:
        raise RuntimeError(f"{path} has less than the {needed / 1e9:.1f} GB free the checkpoint needs")
    generator = torch.Generator("cuda").manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        index += 1
        file = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, shard_bytes = {}, 0

    for name, tensor in random_weights(generator):
        shard[name] = tensor.cpu()
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": needed}, "weight_map": weight_map}))
    return time.perf_counter() - start


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of a 4 GiB tensor, bytes read plus bytes written per second, in GB/s."""
    src = torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**31 * 2 / ms / 1e6


def build_engine(model_dir: Path, in_memory: bool) -> tuple[LLMEngine, float]:
    """The engine with its defaults on CUDA; the KV pool is allocated whole up front, so it never grows (and
    never invalidates captured CUDA graphs) while being timed. Returns the engine and seconds to build it."""
    config = EngineConfig(model=str(model_dir), device="cuda", initial_blocks=1 << 30)
    start = time.perf_counter()
    weights = random_weights(torch.Generator("cuda").manual_seed(0)) if in_memory else None
    llm = LLMEngine(config, weights)
    torch.cuda.synchronize()
    return llm, time.perf_counter() - start


@dataclass
class Run:
    """One batch of requests submitted together and driven to completion."""

    wall_s: float
    completions: list[Completion]
    response_ms: list[float]  # per request: submission -> the step that produced its last token
    full_decode_step_ms: list[float]  # steps in which every request was decoding one token, none prefilling


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of random ordinary token ids: no two share a prefix, so the prefix cache never hits."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def drive(llm: LLMEngine, prompts: list[list[int]], max_new_tokens: int, tag: str) -> Run:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    requests = [Request(f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    start = time.monotonic()
    for r in requests:
        r.arrival = start
        llm.add_request(r)
    arrival = {r.request_id: r.arrival for r in requests}
    completions: list[Completion] = []
    response_ms: list[float] = []
    full_steps: list[float] = []
    while llm.has_unfinished():
        before = llm.stats()
        step_start = time.perf_counter()
        done = llm.step()
        step_ms = (time.perf_counter() - step_start) * 1e3
        now = time.monotonic()
        after = llm.stats()
        computed = after.tokens_computed - before.tokens_computed
        generated = after.tokens_generated - before.tokens_generated
        if computed == generated == len(requests):
            full_steps.append(step_ms)
        for c in done:
            completions.append(c)
            response_ms.append((now - arrival[c.request_id]) * 1e3)
    return Run(time.monotonic() - start, completions, response_ms, full_steps)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def measure_decode(llm: LLMEngine, concurrency: int, floor_ms: float) -> dict:
    """`concurrency` conversations of a 512-token prompt and 128 generated tokens, submitted together."""
    vocab = len(llm.tokenizer)
    drive(llm, random_prompts(concurrency, DECODE_PROMPT_TOKENS, vocab, seed=1000 + concurrency),
          DECODE_OUTPUT_TOKENS, f"warm-{concurrency}")
    run = drive(llm, random_prompts(concurrency, DECODE_PROMPT_TOKENS, vocab, seed=2000 + concurrency),
                DECODE_OUTPUT_TOKENS, f"decode-{concurrency}")
    per_token = [c.timings.decode_ms / (len(c.token_ids) - 1) for c in run.completions if len(c.token_ids) > 1]
    step_ms = mean(run.full_decode_step_ms)
    output_tokens = sum(len(c.token_ids) for c in run.completions)
    return {
        "concurrency": concurrency,
        "prompt_tokens": DECODE_PROMPT_TOKENS,
        "output_tokens": DECODE_OUTPUT_TOKENS,
        # first token -> last token of each conversation over its tokens after the first, averaged over them
        "ms_per_token": mean(per_token),
        "ms_per_token_max": max(per_token, default=float("nan")),
        "full_decode_step_ms": step_ms,
        "full_decode_steps": len(run.full_decode_step_ms),
        "full_decode_step_vs_floor": step_ms / floor_ms,
        "output_tok_s": output_tokens / run.wall_s,
        "wall_s": run.wall_s,
        "all_length": all(c.finish_reason == "length" for c in run.completions),
    }


def measure_chat(llm: LLMEngine) -> dict:
    """50 chat turns (256-token prompt, 64-token reply) submitted at the same instant; submission -> last token."""
    vocab = len(llm.tokenizer)
    drive(llm, random_prompts(CHAT_CONVERSATIONS, CHAT_PROMPT_TOKENS, vocab, seed=3000), CHAT_REPLY_TOKENS, "warm-chat")
    run = drive(llm, random_prompts(CHAT_CONVERSATIONS, CHAT_PROMPT_TOKENS, vocab, seed=4000),
                CHAT_REPLY_TOKENS, "chat")
    response = mean(run.response_ms)
    return {
        "workload": f"{CHAT_CONVERSATIONS} concurrent chat turns submitted at once, {CHAT_PROMPT_TOKENS}-token "
                    f"prompts (no prefix reuse), {CHAT_REPLY_TOKENS}-token replies (ignore_eos)",
        "conversations": CHAT_CONVERSATIONS,
        "prompt_tokens": CHAT_PROMPT_TOKENS,
        "reply_tokens": CHAT_REPLY_TOKENS,
        "mean_response_ms": response,
        "p50_response_ms": percentile(run.response_ms, 0.5),
        "p90_response_ms": percentile(run.response_ms, 0.9),
        "max_response_ms": max(run.response_ms),
        "mean_ttft_ms": mean([c.timings.ttft_ms for c in run.completions]),
        "wall_s": run.wall_s,
        "target_mean_response_ms": CHAT_MEAN_RESPONSE_TARGET_MS,
        "target_met": response < CHAT_MEAN_RESPONSE_TARGET_MS,
        "all_length": all(c.finish_reason == "length" for c in run.completions),
    }


def run(checkpoint: Path | None) -> dict:
    copy_gbs = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = checkpoint or Path(scratch)
        write_config(model_dir)
        write_s = write_shards(model_dir) if checkpoint is not None else 0.0
        llm, build_s = build_engine(model_dir, in_memory=checkpoint is None)
    memory = llm.memory_report()
    floor_ms = memory["weights_bytes"] / (copy_gbs * 1e9) * 1e3
    decode = [measure_decode(llm, c, floor_ms) for c in CONCURRENCIES]
    chat = measure_chat(llm)
    return {
        "device": torch.cuda.get_device_name(),
        "model": {"shape": "Qwen3-32B", **QWEN3_32B, "dtype": "bfloat16", "weights": "random N(0, 0.02)"},
        "weights_route": "safetensors files" if checkpoint is not None else "in memory through engine.model.loader",
        "checkpoint_write_s": write_s,
        "engine_build_s": build_s,
        "engine_config": {k: v for k, v in asdict(llm.config).items() if k != "model"},
        "attention_backend": llm.executor.ops.backend,
        "cuda_graphs": llm.executor.graphs is not None,
        "memory": memory,
        "copy_bandwidth_gbs": copy_gbs,
        "floor_ms_per_token": floor_ms,
        "decode": decode,
        "chat": chat,
        "stats": asdict(llm.stats()),
    }


def print_table(report: dict) -> None:
    print(f"{report['device']}; Qwen3-32B shapes, {report['memory']['weights_bytes'] / 1e9:.1f} GB of bf16 weights "
          f"({report['weights_route']}); backend {report['attention_backend']}, CUDA graphs {report['cuda_graphs']}")
    print(f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s -> floor {report['floor_ms_per_token']:.2f} "
          "ms per decode step (weight bytes / bandwidth)")
    print(f"{'conversations':>13s} {'ms/token':>9s} {'full step ms':>13s} {'x floor':>8s} {'output tok/s':>13s}")
    for d in report["decode"]:
        print(f"{d['concurrency']:13d} {d['ms_per_token']:9.2f} {d['full_decode_step_ms']:13.2f} "
              f"{d['full_decode_step_vs_floor']:7.2f}x {d['output_tok_s']:13.0f}")
    c = report["chat"]
    print(f"chat: {c['workload']}")
    print(f"  response ms mean {c['mean_response_ms']:.0f} p50 {c['p50_response_ms']:.0f} p90 "
          f"{c['p90_response_ms']:.0f} max {c['max_response_ms']:.0f}; ttft mean {c['mean_ttft_ms']:.0f}; "
          f"target mean < {c['target_mean_response_ms']:.0f}: {'met' if c['target_met'] else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_e2e: no CUDA device here; run this on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    report = run(args.checkpoint)
    with open(args.json_path, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    summary = {
        "floor_ms_per_token": report["floor_ms_per_token"],
        "ms_per_token": {str(d["concurrency"]): d["ms_per_token"] for d in report["decode"]},
        "chat_mean_response_ms": report["chat"]["mean_response_ms"],
        "chat_target_met": report["chat"]["target_met"],
        "json": args.json_path,
    }
    print(json.dumps(summary))
    ok = all(d["all_length"] for d in report["decode"]) and report["chat"]["all_length"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
