"""The design's results table on our engine: each optimization added in turn, on one workload, in one run.

    python -m bench.ablation --json

Rows: the `hf` baseline (transformers' generate, static batches of 16), then our engine with packed
continuous batching (decode K/V kept as contiguous per-sequence rows), + the paged KV cache (decode reads
through block tables, no contiguous copy), + prefix reuse, + sparse attention (a sliding window on every
layer). Each row runs in a fresh process so that its peak memory is its own: the growth of the process's
peak RSS over the run (KV cache + activations + allocator slack; on CUDA, peak allocated bytes above the
weights). The workload is multi-turn chat: conversations sharing a system prompt, each turn's prompt being
the previous turns plus a fixed reply and a new message, a turn of every conversation at a time.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

import torch

from bench.common import report, tiny_model
from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.hf_backend import HFEngine
from engine.interface import Request, SamplingParams, StepEngine
from engine.llm_engine import LLMEngine

CONFIGS = {
    "baseline (hf)": None,
    "+ packed continuous batching": dict(enable_prefix_cache=False, dense_decode=True),
    "+ paged KV cache": dict(enable_prefix_cache=False, dense_decode=False),
    "+ prefix reuse": dict(enable_prefix_cache=True, dense_decode=False),
    "+ sparse attention (sliding window)": dict(enable_prefix_cache=True, dense_decode=False,
                                                attention_policy="sliding:128"),
}
CONVERSATIONS, TURNS, SYSTEM_TOKENS, NEW_TOKENS = 24, 4, 200, 32


def waves(vocab: int, seed: int = 0) -> list[list[list[int]]]:
    """Prompts by turn: wave t holds turn t of every conversation."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)]

    system = draw(SYSTEM_TOKENS)
    history = [list(system) for _ in range(CONVERSATIONS)]
    out = []
    for _ in range(TURNS):
        wave = []
        for h in history:
            h += draw(rng.randint(16, 32))  # the user's new message
            wave.append(list(h))
            h += draw(rng.randint(16, 32))  # the reply, fixed so that every row sees the same prompts
        out.append(wave)
    return out


def build(name: str, model: str, device: str) -> StepEngine:
    overrides = CONFIGS[name]
    if overrides is None:
        return HFEngine(model, device=device, max_batch_size=16)
    return LLMEngine(EngineConfig(model=model, device=device, **overrides))


def memory_bytes(device: str) -> int:
    """Allocated device memory on CUDA; on CPU the process's resident set (sampled after every step)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_one(name: str, model: str, device: str) -> dict:
    engine = build(name, model, device)
    prompts = waves(len(engine.tokenizer))
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(Request("warm-up", prompts[0][0][:32], SamplingParams(max_new_tokens=2, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    before = peak = memory_bytes(device)
    per_token, requests, start = [], 0, time.monotonic()
    for t, wave in enumerate(prompts):
        for c, prompt in enumerate(wave):
            engine.add_request(Request(f"{t}:{c}", prompt, sampling))
            requests += 1
        while engine.has_unfinished():
            for done in engine.step():
                per_token.append(done.timings.decode_ms / max(1, len(done.token_ids) - 1))
            peak = max(peak, memory_bytes(device))
    elapsed = time.monotonic() - start
    return {
        "config": name,
        "ms_per_token": round(sum(per_token) / len(per_token), 2),
        "peak_mem_mb": round((peak - before) / 2**20, 1),
        "req_per_s": round(requests / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print only the table's JSON line")
    parser.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)  # a row, in this process
    args = parser.parse_args()
    model = str(tiny_model())
    if args.one:
        print(json.dumps(run_one(args.one, model, args.device)))
        return
    rows = []
    for name in CONFIGS:
        out = subprocess.run([sys.executable, "-m", "bench.ablation", "--one", name, "--device", args.device],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{name}: {rows[-1]}", file=sys.stderr)
    if not args.json:
        print(f"{'config':<38} {'ms/token':>9} {'peak MB':>9} {'req/s':>7}")
        for r in rows:
            print(f"{r['config']:<38} {r['ms_per_token']:>9} {r['peak_mem_mb']:>9} {r['req_per_s']:>7}")
    report({"rows": rows}, json_only=True)


if __name__ == "__main__":
    main()
