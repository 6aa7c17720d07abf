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
token to the last token (the prompts' prefill left out). Each group runs on one side and at once on the other,
which goes first alternating, `--repeat` times; a side's figure is its tokens over its seconds in all, so that a
shared machine whose speed drifts slows both sides alike. Greedy outputs must be identical with and without
drafts (`identical`). The last line is a JSON object: per workload and batch the figures of both sides, their
ratio, the drafts' acceptance rate and mean accepted length (per run), and whether each target is met.
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


def run_group(engine: LLMEngine, group: list[Request], tag: str) -> tuple[int, float, dict[str, list[int]]]:
    """`group` submitted together (arriving at once) and run to its end: its decode tokens and seconds
    (`decode_tok_s`), and each request's output (by its id, `tag` appended to it in the engine)."""
    arrival = time.monotonic()
    for r in group:
        engine.add_request(Request(r.request_id + tag, r.prompt_ids, r.sampling, arrival=arrival))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    tokens, seconds = decode_tok_s(done)
    return tokens, seconds, {c.request_id.removesuffix(tag): c.token_ids for c in done}


def compare(path: Path, requests: list[Request], batch: int, repeat: int, device: str, dtype: str) -> dict:
    """Both sides on `requests`, `batch` at a time, `repeat` times: each group run by one side then at once by
    the other (which goes first alternates), so that a machine whose speed drifts slows both alike; each side's
    figure is its tokens over its seconds in all. Each engine is warmed up on two requests of its own first
    (kernels, the step cost's fit)."""
    engines = {side: LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype, speculative=side))
               for side in ("off", "ngram")}
    for engine in engines.values():
        run_group(engine, [Request(r.request_id, r.prompt_ids[1:], r.sampling) for r in requests[:2]], "#warm")
    before = {side: engine.stats() for side, engine in engines.items()}
    totals = {side: [0, 0.0] for side in engines}
    outputs: dict[str, dict[str, list[int]]] = {side: {} for side in engines}
    for n in range(repeat):
        for g, start in enumerate(range(0, len(requests), batch)):
            sides = list(engines) if (n + g) % 2 == 0 else list(engines)[::-1]
            for side in sides:
                tokens, seconds, done = run_group(engines[side], requests[start:start + batch], f"#{n}")
                totals[side][0] += tokens
                totals[side][1] += seconds
                outputs[side].update(done)
    after = {side: engine.stats() for side, engine in engines.items()}
    tok_s = {side: tokens / seconds for side, (tokens, seconds) in totals.items()}
    drafted = after["ngram"].draft_tokens - before["ngram"].draft_tokens
    accepted = after["ngram"].draft_tokens_accepted - before["ngram"].draft_tokens_accepted
    rows = after["ngram"].draft_rows - before["ngram"].draft_rows
    return {"off_tok_s": round(tok_s["off"], 1), "ngram_tok_s": round(tok_s["ngram"], 1),
            "speedup": round(tok_s["ngram"] / tok_s["off"], 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted": round(accepted / rows, 2) if rows else 0.0, "draft_rows": rows // repeat,
            "steps_off": (after["off"].steps - before["off"].steps) // repeat,
            "steps_ngram": (after["ngram"].steps - before["ngram"].steps) // repeat,
            "tokens": sum(len(t) for t in outputs["off"].values()), "identical": outputs["off"] == outputs["ngram"]}


def run(repeat: int = 3, threads: int = 1, device: str = "cpu", dtype: str = "auto", counts: tuple[int, int] = (8, 32),
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
    parser.add_argument("--repeat", type=int, default=3, help="runs of every group on each side")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    args = parser.parse_args(argv)
    result = run(args.repeat, args.threads, workloads=tuple(args.workloads.split(",")))
    report(result, args.json)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
