"""Host work per engine step: everything but the model, for N sequences decoding together.

    python -m bench.step_overhead --json [--seqs 256] [--device cuda]

The engine runs its real scheduler, input packing, sampling and bookkeeping on the tiny checkpoint, with the
model forward replaced by a stub that hands back fixed hidden states and fixed logits. What is left is the
work the host does per step while, on a GPU, the device would be running the forward: the figure the step
loop must keep under a millisecond so that the GPU never waits on Python. Two workloads run one after the
other: all rows greedy, and all rows sampled (temperature, top-k, top-p, each with its own seed); every row
also carries a stop string that never matches, so stop detection is paid for every token. On a GPU
(`--device cuda`, and a part of `bench.gpu_check`) the stub's tensors and the sampling are on the device: the
figure to set against a step's forward, which the host's work does not overlap.

The stub's vocabulary is small (`--vocab`) so that the arithmetic of sampling, which a GPU does in
microseconds, does not hide the per-row Python work this measures. Parts: `schedule` (the scheduler's choice
and block allocation), `prepare` (the plan's rows, then the executor packing them as tensors), `sample`
(penalties, greedy and random draws), `postprocess` (the rest of the step: appending tokens, stop and length
checks, prefix-cache indexing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

import engine.core.scheduler as scheduler_module
import engine.model.step_executor as step_executor
from bench.common import report, tiny_model
from engine.config import EngineConfig
from engine.interface import Request, SamplingParams
from engine.llm_engine import LLMEngine

PARTS = ("schedule", "prepare", "sample")


class Timers:
    """Seconds spent in each wrapped callable since the last `reset`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.spent = {}


@contextmanager
def stubbed(engine: LLMEngine, vocab: int, timers: Timers):
    """The engine with its forward and logits replaced by fixed tensors, and its parts timed."""
    rows, device = engine.config.max_num_batched_tokens, engine.device
    hidden = torch.zeros(rows, engine.model.shape.hidden_size, device=device)
    logits = torch.randn(engine.config.max_num_seqs, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    executor, model, scheduler = engine.executor, engine.model, engine.scheduler
    saved = (executor.forward, executor.pack, model.compute_logits, scheduler.schedule, step_executor.sample,
             scheduler_module.step_plan)
    executor.forward = timers.wrap("stub", lambda step: hidden[:len(step.input_ids)])
    model.compute_logits = timers.wrap("stub_logits", lambda h: logits[:h.shape[0]].clone())
    executor.pack = timers.wrap("pack", executor.pack)
    scheduler.schedule = timers.wrap("schedule_and_plan", scheduler.schedule)
    scheduler_module.step_plan = timers.wrap("plan", scheduler_module.step_plan)
    step_executor.sample = timers.wrap("sample", step_executor.sample)
    try:
        yield
    finally:
        (executor.forward, executor.pack, model.compute_logits, scheduler.schedule, step_executor.sample,
         scheduler_module.step_plan) = saved


def parts_of(spent: dict[str, float]) -> dict[str, float]:
    """Seconds of each part of a step, from its timers (the plan's rows are built inside `schedule`)."""
    plan = spent.get("plan", 0.0)
    return {"schedule": spent.get("schedule_and_plan", 0.0) - plan, "prepare": plan + spent.get("pack", 0.0),
            "sample": spent.get("sample", 0.0)}


def measure(engine: LLMEngine, timers: Timers, params: SamplingParams, seqs: int, prompt_len: int,
            warmup: int, steps: int, tag: str) -> dict[str, float]:
    """Milliseconds per step of host work (and of each part) with `seqs` sequences decoding."""
    for i in range(seqs):
        prompt = [(i * 7 + j) % 4000 + 10 for j in range(prompt_len)]
        engine.add_request(Request(f"{tag}-{i}", prompt, params))
    for _ in range(warmup):  # prefills first, then decodes only
        engine.step()
    totals, parts = [], {p: [] for p in (*PARTS, "postprocess")}
    for _ in range(steps):
        timers.reset()
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        stub = timers.spent.get("stub", 0.0) + timers.spent.get("stub_logits", 0.0)
        host = total - stub
        totals.append(host)
        spent = parts_of(timers.spent)
        for p in PARTS:
            parts[p].append(spent[p])
        parts["postprocess"].append(host - sum(spent.values()))
    for i in range(seqs):
        engine.abort_request(f"{tag}-{i}")
    result = {"host_ms_per_step": round(1e3 * statistics.median(totals), 3)}
    result.update({f"{p}_ms": round(1e3 * statistics.median(v), 3) for p, v in parts.items()})
    return result


def run(model: Path, seqs: int = 256, prompt: int = 64, warmup: int = 40, steps: int = 50, vocab: int = 512,
        device: str = "cpu") -> dict:
    """Both workloads' host ms per step (and per part) with `seqs` sequences decoding, on the `model` folder
    (the tiny checkpoint: its forward is stubbed, only its shapes matter)."""
    # without drafts: the stub's fixed logits make every row repeat one token, which speculation would verify
    # several at a time, and this measures a step of one token per row
    config = EngineConfig(model=str(model), device=device, max_num_seqs=seqs,
                          max_num_batched_tokens=max(4096, seqs), dense_decode=False, kv_cache_memory=1 << 30,
                          speculative="off")
    engine = LLMEngine(config)
    timers = Timers()
    new = warmup + steps + 8
    workloads = {
        "greedy": SamplingParams(max_new_tokens=new, ignore_eos=True, stop=["<never>"]),
        "sampled": SamplingParams(max_new_tokens=new, temperature=0.8, top_p=0.9, top_k=50, seed=1,
                                  ignore_eos=True, stop=["<never>"]),
    }
    result: dict = {"seqs": seqs, "vocab": vocab, "steps": steps, "device": device}
    with stubbed(engine, vocab, timers):
        for name, params in workloads.items():
            figures = measure(engine, timers, params, seqs, prompt, warmup, steps, name)
            result.update({f"{name}_{k}": v for k, v in figures.items()})
    result["host_ms_per_step"] = max(result["greedy_host_ms_per_step"], result["sampled_host_ms_per_step"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256, help="sequences decoding in every step")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of each sequence")
    parser.add_argument("--warmup", type=int, default=40, help="steps before measuring (prefills included)")
    parser.add_argument("--steps", type=int, default=50, help="steps measured per workload")
    parser.add_argument("--vocab", type=int, default=512, help="columns of the stub's logits")
    parser.add_argument("--device", default="cpu", help="where the stub's tensors and the sampling are")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    args = parser.parse_args()
    torch.set_num_threads(1)  # what one engine loop gets of a busy machine
    report(run(tiny_model(), args.seqs, args.prompt, args.warmup, args.steps, args.vocab, args.device), args.json)


if __name__ == "__main__":
    main()
