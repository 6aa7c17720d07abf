"""Speculative decoding, measured: decode tokens/s with and without drafts, side by side in one run.

    python -m bench.speculative --json [--repeat N] [--threads N]

Three workloads, each at batch 1 (requests one after another) and batch 16 (sixteen at once), each run by an
engine with `speculative="off"` and one with `"ngram"` (default `EngineConfig` otherwise, fp32 on the CPU):

- `copy`: summaries whose output quotes the transcript, from a tiny Qwen3 trained here to do that
  (`bench.copy_model`, built once under `.convoq/models/`), on held-out transcripts; greedy, to its own end.
- `no_copy`: random prompts (nothing to copy) to the random-weight `tiny` model, 96 tokens each.
- `records`: the demo's JSON records (`cli.demo.RECORD_SCHEMA`) of the demo's transcripts that fit the tiny
  model's context, under the schema's grammar, from the random-weight `tiny` model the demo runs.

Decode tokens/s of a group of requests is the tokens after each one's first over the time from the last first
token to the last token (the prompts' prefill left out); a side's figure is its best of `--repeat` runs, the two
sides alternating. Greedy outputs must be identical with and without drafts (`identical`). The last line is a
JSON object: per workload and batch the figures of both sides, their ratio, the drafts' acceptance rate and
mean accepted length, and whether each target is met.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bench.common import report, tiny_model
from bench.copy_model import copy_model, example
from engine.config import EngineConfig
from engine.interface import Completion, GrammarKind, GrammarSpec, Request, SamplingParams
from engine.llm_engine import LLMEngine

TARGETS = {"copy_batch_1": 1.8, "copy_batch_16": 1.3, "no_copy_batch_1": 0.95, "no_copy_batch_16": 0.95,
           "records_batch_1": 1.3, "records_batch_16": 1.3}
BATCHES = (1, 16)
SAMPLES = Path(__file__).resolve().parent.parent / "cli" / "samples" / "transcripts.jsonl"


def copy_requests(path: Path, count: int, seed: int) -> list[Request]:
    """Held-out transcripts (seeds the training never drew) to be summarized by quoting them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [Request(f"copy{i}", example(random.Random(seed + 10_000 + i), tokenizer),
                    SamplingParams(max_new_tokens=128)) for i in range(count)]


def no_copy_requests(path: Path, count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"free{i}", [rng.randrange(3, 4096) for _ in range(rng.randint(100, 300))],
                    SamplingParams(max_new_tokens=96, ignore_eos=True)) for i in range(count)]


def record_requests(path: Path, count: int, seed: int) -> list[Request]:
    """The demo's transcripts as summarize jobs' prompts, each answered as the demo's record."""
    from transformers import AutoTokenizer

    from cli.demo import RECORD_SCHEMA
    from jobs.chat import chat_for, encode_chat
    from jobs.schemas import JobIn

    tokenizer = AutoTokenizer.from_pretrained(path)
    grammar = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(RECORD_SCHEMA, separators=(",", ":")))
    prompts = []
    for line in SAMPLES.read_text().splitlines():
        job = JobIn(kind="summarize", messages=json.loads(line)["transcript"])
        ids = encode_chat(tokenizer, chat_for(job), thinking=False)
        if len(ids) + 160 <= 1024:  # the tiny model's context
            prompts.append(ids)
    rng = random.Random(seed)
    return [Request(f"record{i}", rng.choice(prompts), SamplingParams(max_new_tokens=160, grammar=grammar))
            for i in range(count)]


WORKLOADS = {"copy": (copy_model, copy_requests), "no_copy": (tiny_model, no_copy_requests),
             "records": (tiny_model, record_requests)}


def decode_tok_s(completions: list[Completion]) -> tuple[int, float]:
    """A group's tokens after each request's first, and the seconds from its last first token to its end."""
    first = [c.timings.ttft_ms for c in completions]
    last = [c.timings.ttft_ms + c.timings.decode_ms for c in completions]
    return sum(len(c.token_ids) - 1 for c in completions), (max(last) - max(first)) / 1e3


def run_side(engine: LLMEngine, requests: list[Request], batch: int) -> dict:
    """`requests` through `engine`, `batch` at a time (each group submitted together, arriving at once)."""
    before = engine.stats()
    tokens = seconds = 0.0
    outputs = {}
    for start in range(0, len(requests), batch):
        arrival = time.monotonic()
        for r in requests[start:start + batch]:
            engine.add_request(Request(r.request_id, r.prompt_ids, r.sampling, arrival=arrival))
        done = []
        while engine.has_unfinished():
            done += engine.step()
        n, s = decode_tok_s(done)
        tokens, seconds = tokens + n, seconds + s
        outputs.update((c.request_id, c.token_ids) for c in done)
    after = engine.stats()
    drafted, accepted = after.draft_tokens - before.draft_tokens, after.draft_tokens_accepted - before.draft_tokens_accepted
    rows = after.draft_rows - before.draft_rows
    return {"tok_s": tokens / seconds, "steps": after.steps - before.steps, "drafted": drafted,
            "accepted": accepted, "rows": rows, "outputs": outputs}


def compare(path: Path, requests: list[Request], batch: int, repeat: int, device: str, dtype: str) -> dict:
    """Both sides on `requests` at `batch`, alternating, the best of `repeat` runs each; each engine warmed up on
    two requests of its own first (kernels, the step cost's fit)."""
    engines = {side: LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype, speculative=side))
               for side in ("off", "ngram")}
    for side, engine in engines.items():
        run_side(engine, [Request(f"warm-{side}-{r.request_id}", r.prompt_ids[1:], r.sampling) for r in requests[:2]],
                 batch)
    best: dict[str, dict] = {}
    for n in range(repeat):
        for side, engine in engines.items():
            run = run_side(engine, [Request(f"{r.request_id}#{n}", r.prompt_ids, r.sampling) for r in requests], batch)
            run["outputs"] = {k.partition("#")[0]: v for k, v in run["outputs"].items()}
            if side not in best or run["tok_s"] > best[side]["tok_s"]:
                best[side] = run
    off, on = best["off"], best["ngram"]
    identical = off["outputs"] == on["outputs"]
    return {"off_tok_s": round(off["tok_s"], 1), "ngram_tok_s": round(on["tok_s"], 1),
            "speedup": round(on["tok_s"] / off["tok_s"], 3),
            "acceptance_rate": round(on["accepted"] / on["drafted"], 3) if on["drafted"] else 0.0,
            "mean_accepted": round(on["accepted"] / on["rows"], 2) if on["rows"] else 0.0,
            "draft_rows": on["rows"], "steps_off": off["steps"], "steps_ngram": on["steps"],
            "tokens": sum(len(t) for t in off["outputs"].values()), "identical": identical}


def run(repeat: int = 2, threads: int = 1, device: str = "cpu", dtype: str = "auto", counts: tuple[int, int] = (8, 32),
        workloads: tuple[str, ...] = tuple(WORKLOADS), seed: int = 0) -> dict:
    torch.set_num_threads(threads)
    result: dict = {"device": device, "threads": threads, "repeat": repeat}
    for name in workloads:
        model, make = WORKLOADS[name]
        path = model()
        for batch, count in zip(BATCHES, counts, strict=True):
            print(f"{name} at batch {batch}", file=sys.stderr)
            result[f"{name}_batch_{batch}"] = compare(path, make(path, count, seed), batch, repeat, device, dtype)
    measured = [k for k in TARGETS if k in result]
    result["targets"] = {k: TARGETS[k] for k in measured}
    result["met"] = {k: result[k]["speedup"] >= TARGETS[k] for k in measured}
    result["identical"] = all(result[k]["identical"] for k in measured)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side; each side's best counts")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    args = parser.parse_args(argv)
    result = run(args.repeat, args.threads, workloads=tuple(args.workloads.split(",")))
    report(result, args.json)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
