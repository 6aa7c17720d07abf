"""Do urgent chats stay fast while bulk work saturates the same engine?

    python -m bench.mixed --json               # the engine alone, in this process
    python -m bench.mixed --pipeline --json    # through API + Celery + Redis + the database

Engine scenario (tiny model, default `EngineConfig`), in one process, each phase on a fresh warmed-up engine:

1. idle: `--chats` priority-9 chats (prompts 30-120 tokens, replies 16-48) arriving one every
   1/`--chat-rate` seconds, nothing else running;
2. bulk alone: a backlog of `--bulk` priority-1 requests (prompts 400-900 tokens, outputs 64-128), all
   there at the start, as an uploaded batch would be;
3. mixed: a fresh backlog of the same size and, half a second later, the same chat schedule;

2 and 3 are repeated `--repeat` times, side by side, because this machine's speed drifts by tens of percent
within minutes: `bulk_keep` is the median of the pairs' ratios, the mixed chat figures pool all repeats.

Prompts are random token ids, fresh in every phase (no prefix-cache hits across phases); every request
ignores EOS, so each side generates exactly its budget. A chat's latency is from its scheduled arrival to
its completion (so time spent waiting for the step in flight counts); time per output token is its decode
time over its tokens after the first. Bulk throughput is bulk tokens over the time from the backlog's start
to its last completion. The last line is one JSON object: `chat_p95_idle_ms`, `chat_p95_mixed_ms`,
`chat_p95_ratio`, `chat_tpot_ratio`, `bulk_keep` (bulk tokens/s mixed over alone) and the details.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from bench.common import chat_comparison, chat_figures, report, tiny_model
from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.interface import Completion, Request, SamplingParams
from engine.llm_engine import LLMEngine
from jobs.priority import DEFAULT_BATCH_PRIORITY, HIGHEST

CHAT_PRIORITY, BULK_PRIORITY = HIGHEST, DEFAULT_BATCH_PRIORITY
VOCAB = 4096


@dataclass
class Planned:
    request: Request
    due: float  # seconds after the phase starts


def planned(rng: random.Random, tag: str, count: int, prompt: tuple[int, int], output: tuple[int, int],
            priority: int, every: float, start: float) -> list[Planned]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(len(SPECIAL_TOKENS), VOCAB) for _ in range(n)]

    return [Planned(Request(f"{tag}{i}", ids(rng.randint(*prompt)),
                            SamplingParams(max_new_tokens=rng.randint(*output), ignore_eos=True), priority,
                            interactive=priority == CHAT_PRIORITY),
                    start + i * every) for i in range(count)]


def run_phase(engine: LLMEngine, work: list[Planned], desc: str) -> tuple[dict[str, Completion], dict[str, float]]:
    """Submit each request when it is due (its arrival is that moment) and step until all are done;
    returns the completions and each request's end-to-end seconds."""
    pending = sorted(work, key=lambda p: p.due)
    start = time.monotonic()
    arrival: dict[str, float] = {}
    done: dict[str, Completion] = {}
    latency: dict[str, float] = {}
    with tqdm(total=len(work), desc=desc, unit="req", file=sys.stderr) as bar:
        while len(done) < len(work):
            now = time.monotonic()
            while pending and start + pending[0].due <= now:
                p = pending.pop(0)
                p.request.arrival = arrival[p.request.request_id] = start + p.due
                engine.add_request(p.request)
            if not engine.has_unfinished():
                time.sleep(max(0.0, start + pending[0].due - time.monotonic()))
                continue
            for completion in engine.step():
                done[completion.request_id] = completion
                latency[completion.request_id] = time.monotonic() - arrival[completion.request_id]
                bar.update()
    return done, latency


def chat_latency(done: dict[str, Completion], latency: dict[str, float], ids: list[str]) -> dict[str, float]:
    return chat_figures([latency[i] * 1e3 for i in ids], [done[i].timings.ttft_ms for i in ids],
                        [done[i].timings.decode_ms / max(1, len(done[i].token_ids) - 1) for i in ids])


def bulk_tok_s(done: dict[str, Completion], latency: dict[str, float], ids: list[str]) -> tuple[float, float]:
    """Bulk tokens per second, and when the last bulk request finished (seconds after the phase started)."""
    last = max(latency[i] for i in ids)  # every bulk request arrived at the phase's start
    return sum(len(done[i].token_ids) for i in ids) / last, last


def fresh_engine(rng: random.Random, device: str) -> LLMEngine:
    """A warmed-up engine that has seen no interactive request (each phase gets its own: an engine that saw one
    keeps its bulk steps short for `interactive_window` seconds, expecting more)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model()), device=device))
    run_phase(engine, planned(rng, "warm", 8, (30, 600), (8, 16), BULK_PRIORITY, 0.0, 0.0), "warm-up")
    return engine


def run_engine(chats: int, chat_rate: float, bulk: int, repeat: int, seed: int, device: str = "cpu") -> dict:
    rng = random.Random(seed)

    def chat_plan(tag: str, start: float) -> list[Planned]:
        return planned(rng, tag, chats, (30, 120), (16, 48), CHAT_PRIORITY, 1 / chat_rate, start)

    def bulk_plan(tag: str) -> list[Planned]:
        return planned(rng, tag, bulk, (400, 900), (64, 128), BULK_PRIORITY, 0.0, 0.0)

    idle_done, idle_latency = run_phase(fresh_engine(rng, device), chat_plan("idle", 0.0), "chats, idle engine")
    idle = chat_latency(idle_done, idle_latency, [f"idle{i}" for i in range(chats)])
    keeps, alone_rates, mixed_rates = [], [], []
    mixed_done: dict[str, Completion] = {}
    mixed_latency: dict[str, float] = {}
    during: list[str] = []
    for r in range(repeat):  # alone and mixed side by side, so a drift in the machine's speed hits both
        done, latency = run_phase(fresh_engine(rng, device), bulk_plan(f"alone{r}-"), f"bulk alone ({r + 1}/{repeat})")
        alone_rate, _ = bulk_tok_s(done, latency, [f"alone{r}-{i}" for i in range(bulk)])
        engine = fresh_engine(rng, device)
        done, latency = run_phase(engine, bulk_plan(f"bulk{r}-") + chat_plan(f"chat{r}-", 0.0),
                                  f"bulk + chats ({r + 1}/{repeat})")
        mixed_rate, mixed_s = bulk_tok_s(done, latency, [f"bulk{r}-{i}" for i in range(bulk)])
        mixed_done |= done
        mixed_latency |= latency
        # only chats that arrived while the backlog still ran say anything about contention
        during += [f"chat{r}-{i}" for i in range(chats) if i / chat_rate < mixed_s]
        keeps.append(mixed_rate / alone_rate)
        alone_rates.append(alone_rate)
        mixed_rates.append(mixed_rate)
    mixed = chat_latency(mixed_done, mixed_latency, during)
    stats = engine.stats()
    return {
        "mode": "engine",
        "chats": chats, "chat_rate": chat_rate, "chats_during_bulk": len(during), "bulk": bulk, "repeat": repeat,
        **chat_comparison(idle, mixed),
        "bulk_tok_s_alone": [round(x, 1) for x in alone_rates], "bulk_tok_s_mixed": [round(x, 1) for x in mixed_rates],
        "bulk_keep": round(statistics.median(keeps), 3), "bulk_keep_each": [round(k, 3) for k in keeps],
        "preemptions": stats.preemptions, "preemptions_spared": stats.preemptions_spared,
        "bulk_rows_deferred": stats.bulk_rows_deferred, "limited_steps": stats.limited_steps,
        **{k: round(v * 1e3, 5) for k, v in stats.items() if k.startswith("step_") and k.endswith("_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", action="store_true", help="through the service instead of the engine alone")
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--chat-rate", type=float, default=1.0, help="chats per second")
    parser.add_argument("--bulk", type=int, default=256, help="engine: bulk requests in the backlog")
    parser.add_argument("--repeat", type=int, default=2, help="engine: bulk alone / mixed pairs")
    parser.add_argument("--transcripts", type=int, default=256, help="pipeline: transcripts in each batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="engine: where the engine runs")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    if args.pipeline:
        from bench.mixed_pipeline import run_pipeline

        result = run_pipeline(args.chats, args.chat_rate, args.transcripts, 32, args.seed)
    else:
        result = run_engine(args.chats, args.chat_rate, args.bulk, args.repeat, args.seed, args.device)
    report(result, args.json)


if __name__ == "__main__":
    main()
