"""Our engine against transformers' `generate` (static batches of 16) on the same workload, in one run.

    python -m bench.engine_vs_hf --json [--model tiny|moe|0.6b] [--device cpu]

The models are `cli.tiny_model` presets with random weights, built once into `.convoq/models/`: `tiny` (Qwen3),
`moe` (`tiny-moe`, Qwen3-MoE: 8 experts, 2 a token, a dense first layer) and `0.6b` (Qwen3-0.6B's shapes). Every request
ignores EOS, so both sides generate exactly the drawn number of tokens; tokens/s counts generated tokens over
wall time from submission to the last completion. Progress goes to stderr; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from bench.common import tiny_model
from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.hf_backend import HFEngine
from engine.interface import Request, SamplingParams, StepEngine
from engine.llm_engine import LLMEngine

# model -> (requests, prompt length range, output length range)
WORKLOADS = {"tiny": (64, (16, 512), (16, 128)), "0.6b": (32, (16, 256), (16, 128))}
WORKLOADS["moe"] = WORKLOADS["tiny"]  # the dense model's work, at the same hidden size and depth
PRESETS = {"tiny": "tiny", "moe": "tiny-moe", "0.6b": "0.6b"}  # model -> its `cli.tiny_model` preset

def make_requests(preset: str, vocab: int, seed: int, tag: str, count: int | None = None) -> list[Request]:
    """The preset's workload (its first `count` requests, when given)."""
    total, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[preset]
    count = total if count is None else count
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rng.randint(p_lo, p_hi))]
        sampling = SamplingParams(max_new_tokens=rng.randint(o_lo, o_hi), ignore_eos=True)
        requests.append(Request(f"{tag}-{i}", prompt, sampling))
    return requests


def drain(engine: StepEngine, requests: list[Request], label: str) -> tuple[int, float]:
    """Generated tokens and seconds for `requests` submitted together and run to completion."""
    start = time.monotonic()
    for request in requests:
        engine.add_request(request)
    tokens = 0
    with tqdm(total=len(requests), desc=label, file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished():
            done = engine.step()
            tokens += sum(len(c.token_ids) for c in done)
            bar.update(len(done))
    return tokens, time.monotonic() - start


def measure(engine: StepEngine, preset: str, vocab: int, seed: int, label: str, repeat: int,
            count: int | None = None) -> float:
    """Best tokens/s of `repeat` runs of the workload, after a short warm-up.

    Each run draws fresh prompts (seed + 1000 * run; both sides see the same ones), so that a repeat cannot
    be served from the engine's prefix cache.
    """
    warmup = [replace(r, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
              for r in make_requests(preset, vocab, seed + 1, "warmup")[:2]]
    drain(engine, warmup, f"{label} warm-up")
    rates = []
    for run in range(repeat):
        requests = make_requests(preset, vocab, seed + 1000 * run, f"{label}{run}", count)
        tokens, seconds = drain(engine, requests, label)
        rates.append(tokens / seconds)
        print(f"{label:>6}: {tokens} tokens in {seconds:.2f} s = {rates[-1]:.0f} tok/s")
    return max(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations, the same on both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="runs per side; the best counts (noisy machines)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    path = tiny_model(PRESETS[args.model])

    engine = LLMEngine(EngineConfig(model=str(path), device=args.device, dtype=args.dtype))
    vocab = len(engine.tokenizer)
    engine_rate = measure(engine, args.model, vocab, args.seed, "engine", args.repeat)
    dtype = str(engine.config.torch_dtype).removeprefix("torch.")
    del engine
    hf = HFEngine(str(path), device=args.device, dtype=args.dtype, max_batch_size=16)
    hf_rate = measure(hf, args.model, vocab, args.seed, "hf", args.repeat)
    print(f" ratio: {engine_rate / hf_rate:.2f}x")
    if args.json:
        print(json.dumps({"engine_tok_s": round(engine_rate, 1), "hf_tok_s": round(hf_rate, 1),
                          "ratio": round(engine_rate / hf_rate, 2), "model": args.model, "device": args.device,
                          "dtype": dtype}))


if __name__ == "__main__":
    main()
