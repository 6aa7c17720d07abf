"""Our engine in bf16 against transformers in bf16 and in fp32: greedy agreement and logit differences.

    python -m bench.bf16_fidelity --json [--prompts 8] [--prompt-len 32 96] [--new-tokens 32] [--seed 0]

The model is the `0.6b` preset of `cli.tiny_model` (Qwen3-0.6B's shapes, random weights), built once into
`.convoq/models/`. The same random prompts go through three models, one after the other: transformers in fp32
(the reference), transformers in bf16, and our `LLMEngine` in bf16.

1. Greedy generation of `--new-tokens` tokens per prompt, EOS ignored. transformers runs all prompts as one
   left-padded `generate` batch; the engine takes them all at once, as in service.
2. Teacher-forced logits: each prompt plus the fp32 reference's continuation, one forward per model, logits at
   every position. The engine only computes logits where it samples, so its final hidden states are caught
   from `StepExecutor.forward` and put through its own `compute_logits`; its prefix cache is off so that the
   forward covers every position (the prompts are distinct, so generation would not hit it anyway).

For each pair: the fraction of prompts whose whole continuation is identical, the mean fraction of tokens
identical up to the first divergence, the first-divergence positions (null: none), the top-1 agreement over
all teacher-forced positions, max and mean |logit difference| over all positions and at the last one, and
the largest fp32 top-1/top-2 margin at a position where the pair's top-1 differs (small: they only part at
near-ties). Progress goes to stderr; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, Qwen3ForCausalLM

from bench.common import report, tiny_model
from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.interface import Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.step_executor import PackedStep

# label -> (first side, second side)
PAIRS = {"ours_vs_hf16": ("ours_bf16", "hf_bf16"), "ours_vs_hf32": ("ours_bf16", "hf_fp32"),
         "hf16_vs_hf32": ("hf_bf16", "hf_fp32")}


def make_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def hf_generate(model: Qwen3ForCausalLM, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    with torch.inference_mode():
        # eos_token_id=None, as HFEngine does for ignore_eos: every row runs the full length
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=pad_id)
    assert out.shape[1] == longest + new_tokens
    return out[:, longest:].tolist()


def hf_logits(model: Qwen3ForCausalLM, sequences: list[list[int]], label: str) -> list[torch.Tensor]:
    """fp32 logits [len, vocab] of each sequence, one unpadded forward each."""
    out = []
    with torch.inference_mode():
        for seq in tqdm(sequences, desc=f"{label} teacher-forced", file=sys.stderr, leave=False):
            out.append(model(torch.tensor([seq])).logits[0].float())
    return out


def run_engine(engine: LLMEngine, requests: list[Request], label: str) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    done = {}
    with tqdm(total=len(requests), desc=label, file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished():
            for completion in engine.step():
                done[completion.request_id] = completion.token_ids
            bar.update(len(done) - bar.n)
    return done


def engine_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    done = run_engine(engine, [Request(f"gen-{i}", p, sampling) for i, p in enumerate(prompts)], "ours generate")
    return [done[f"gen-{i}"] for i in range(len(prompts))]


def engine_logits(engine: LLMEngine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits [len, vocab] of each sequence from the engine's own forward and head."""
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    forward = engine.executor.forward

    def catch(step: PackedStep) -> torch.Tensor:
        hidden = forward(step)
        bounds, positions = step.cu_seqlens.tolist(), step.positions.tolist()
        for i, request_id in enumerate(step.request_ids):
            # keyed by the chunk's first position
            chunks.setdefault(request_id, []).append((positions[bounds[i]], hidden[bounds[i]:bounds[i + 1]]))
        return hidden

    engine.executor.forward = catch
    try:
        sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
        run_engine(engine, [Request(f"tf-{i}", s, sampling) for i, s in enumerate(sequences)], "ours teacher-forced")
    finally:
        engine.executor.forward = forward
    out = []
    with torch.inference_mode():
        for i, seq in enumerate(sequences):
            hidden = torch.cat([h for _, h in sorted(chunks[f"tf-{i}"], key=lambda c: c[0])])
            assert len(hidden) == len(seq), "the engine skipped positions (prefix cache?)"
            out.append(engine.model.compute_logits(hidden))
    return out


def greedy_agreement(a: list[list[int]], b: list[list[int]], new_tokens: int) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), new_tokens)
             for p, q in zip(a, b, strict=True)]
    return {"identical": round(sum(f == new_tokens for f in first) / len(first), 3),
            "prefix": round(sum(first) / (new_tokens * len(first)), 3),
            "first_div": [f if f < new_tokens else None for f in first]}


def logit_differences(a: list[torch.Tensor], b: list[torch.Tensor], margins: list[torch.Tensor]) -> dict:
    """`margins`: the fp32 reference's top-1 minus top-2 logit at every position."""
    diffs = [(x - y).abs() for x, y in zip(a, b, strict=True)]
    agree = [x.argmax(-1) == y.argmax(-1) for x, y in zip(a, b, strict=True)]
    positions = sum(len(d) for d in diffs)
    parted = torch.cat([m[~g] for m, g in zip(margins, agree, strict=True)])
    return {"top1": round(sum(int(g.sum()) for g in agree) / positions, 4),
            "max_abs": round(max(float(d.max()) for d in diffs), 4),
            "mean_abs": round(sum(float(d.sum()) for d in diffs) / (positions * diffs[0].shape[1]), 5),
            "last_max_abs": round(max(float(d[-1].max()) for d in diffs), 4),
            "last_mean_abs": round(sum(float(d[-1].mean()) for d in diffs) / len(diffs), 5),
            "parted_margin_max": round(float(parted.max()), 4) if len(parted) else None}


def load_hf(path: str, dtype: torch.dtype) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.6b", help="a cli.tiny_model preset")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args()
    start = time.monotonic()
    path = str(tiny_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(args.prompts, *args.prompt_len, len(tokenizer), args.seed)
    tokens: dict[str, list[list[int]]] = {}
    logits: dict[str, list[torch.Tensor]] = {}

    # the fp32 reference first: the teacher-forced sequences are the prompts plus its continuations
    model = load_hf(path, torch.float32)
    print("hf_fp32 generate", file=sys.stderr)
    tokens["hf_fp32"] = hf_generate(model, prompts, args.new_tokens, tokenizer.pad_token_id)
    sequences = [p + c for p, c in zip(prompts, tokens["hf_fp32"], strict=True)]
    logits["hf_fp32"] = hf_logits(model, sequences, "hf_fp32")
    del model
    gc.collect()

    model = load_hf(path, torch.bfloat16)
    print("hf_bf16 generate", file=sys.stderr)
    tokens["hf_bf16"] = hf_generate(model, prompts, args.new_tokens, tokenizer.pad_token_id)
    logits["hf_bf16"] = hf_logits(model, sequences, "hf_bf16")
    del model
    gc.collect()

    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", device="cpu", enable_prefix_cache=False))
    tokens["ours_bf16"] = engine_generate(engine, prompts, args.new_tokens)
    logits["ours_bf16"] = engine_logits(engine, sequences)
    del engine
    gc.collect()

    margins = [x.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for x in logits["hf_fp32"]]
    result: dict = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
                    "positions": sum(len(s) for s in sequences),
                    "fp32_margin_median": round(float(torch.cat(margins).median()), 4),
                    "fp32_logit_std": round(sum(float(x.std()) for x in logits["hf_fp32"]) / len(sequences), 4)}
    for label, (a, b) in PAIRS.items():
        result[label] = {**greedy_agreement(tokens[a], tokens[b], args.new_tokens),
                         **logit_differences(logits[a], logits[b], margins)}
    result["wall_s"] = round(time.monotonic() - start, 1)
    report(result, args.json)


if __name__ == "__main__":
    main()
