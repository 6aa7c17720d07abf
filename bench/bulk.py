"""Bulk summarization throughput: the whole service versus the engine alone, on the same transcripts.

    python -m bench.bulk --transcripts 500 --json

The service run uploads one batch through the API and times it from the upload to the moment the batch
completed in the database, its last result stored (API -> Postgres + Redis -> worker -> engine -> Postgres);
the client polls its status only every half second, to stay out of the way on a small machine. The engine
run feeds the same jobs to the worker's own bridge in this process (same prompts, same map-reduce, the engine
in a process of its own as in a worker), with nothing around it. The ratio says how well
the pipeline keeps the engine busy. Broker and database come from CONVOQ_BROKER_URL / CONVOQ_DATABASE_URL.

`loop_gap_p95_ms` is the engine loop's idle time between two back-to-back steps while the pipeline runs, read
from the worker's metrics when the batch completed (`engine_loop_gap_p95_ms`: the same with the engine
alone): on a GPU, where a step takes milliseconds, that gap is the device waiting on the worker's Python.
The service runs twice, side by side: with the engine in a process of its own (the default) and as a thread
of the worker (`CONVOQ_ENGINE_PROCESS=false`, the `thread_` figures), which shares the interpreter lock with
the worker's Celery threads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from tqdm import tqdm

from api.http.client import Client
from bench.common import report, scraped, tiny_model
from bench.engine_alone import through_engine
from cli.batch import follow
from cli.demo import SAMPLES, send_chats
from cli.servers import free_port
from cli.stack import Stack
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Batch, Job, Result, as_utc
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"


def workload(n: int, max_new_tokens: int) -> list[dict]:
    """`n` batch lines cycling through the bundled transcripts (a few of them need map-reduce)."""
    samples = [json.loads(line) for line in SAMPLES.read_text().splitlines()]
    return [{"custom_id": f"{samples[i % len(samples)]['custom_id']}-{i}",
             "transcript": samples[i % len(samples)]["transcript"], "max_new_tokens": max_new_tokens}
            for i in range(n)]


def loop_gap_ms(metrics_url: str) -> float:
    """The worker's engine loop gap p95, from its Prometheus metrics."""
    if (gap := scraped(metrics_url, "convoq_engine_loop_gap_p95_milliseconds").get(())) is None:
        raise RuntimeError("the worker reports no engine loop gap")
    return gap


def service_env(settings: Settings, model: Path, metrics_port: int, engine_process: bool = True) -> dict[str, str]:
    return {"CONVOQ_DATABASE_URL": settings.database_url.get_secret_value(),
            "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(),
            "CONVOQ_MODEL": str(model), "CONVOQ_API_KEYS": KEY, "CONVOQ_WORKER_METRICS_PORT": str(metrics_port),
            "CONVOQ_ENGINE_PROCESS": str(engine_process).lower(),
            # the worker's counters are read before and after each batch: fresh each time
            "CONVOQ_METRICS_REFRESH_S": "0.2"}


def run_batch(client: Client, lines: list[dict], settings: Settings) -> tuple[float, int]:
    """One batch of `lines` through the API: seconds from the upload until it completed in the database (its
    last result stored, not the client's next poll), and its generated tokens."""
    start = datetime.now(UTC)
    batch = client.create_batch("\n".join(json.dumps(x) for x in lines).encode(), name="bench.jsonl")
    batch = follow(client, str(batch.id), poll=0.5)
    if batch.request_counts.completed != len(lines):
        raise RuntimeError(f"the service finished only {batch.request_counts.completed}/{len(lines)}: {batch}")
    engine = sa.create_engine(settings.database_url.get_secret_value())
    with engine.connect() as conn:
        tokens = conn.execute(sa.select(sa.func.sum(Result.completion_tokens)).join(Job, Job.id == Result.job_id)
                              .where(Job.batch_id == batch.id)).scalar_one()
        completed = conn.execute(sa.select(Batch.completed_at).where(Batch.id == batch.id)).scalar_one()
    engine.dispose()
    return (as_utc(completed) - start).total_seconds(), int(tokens)


def through_service(lines: list[dict], settings: Settings, model: Path, engine_process: bool = True
                    ) -> tuple[float, int, float]:
    metrics_port = free_port()
    with Stack(service_env(settings, model, metrics_port, engine_process),
               Path(tempfile.mkdtemp(prefix="convoq-bulk-"))) as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, KEY, timeout=600) as client:
            seconds, tokens = run_batch(client, lines, settings)
        gap_ms = loop_gap_ms(f"http://127.0.0.1:{metrics_port}/metrics")
    return seconds, tokens, gap_ms


def repeated(lines: list[dict], settings: Settings, model: Path, repeats: int) -> dict:
    """The same batch `repeats` times on one warm service (API and worker started once), after a warm-up
    batch, with a round of customer chats before each repeat: whatever a run leaves behind (the scheduler's
    state, the step-cost fit, the pools, the host tier, the collector) shows as a slower repeat. Each repeat's
    engine steps and steps under a time limit (the worker's counters) tell a slower engine from a slower plan."""
    port = free_port()
    metrics = f"http://127.0.0.1:{port}/metrics"

    def counters() -> tuple[float, float]:
        return tuple(scraped(metrics, f"convoq_engine_{name}_total").get((), 0.0) for name in ("steps", "limited_steps"))

    with Stack(service_env(settings, model, port), Path(tempfile.mkdtemp(prefix="convoq-bulk-"))) as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, KEY, timeout=600) as client:
            run_batch(client, lines, settings)
            seconds, steps, limited, load = [], [], [], []
            for r in tqdm(range(repeats), desc="repeats", disable=None):
                for chat in send_chats(client, ticket=1000 * (r + 1)):
                    client.wait(chat, timeout=300)
                before = counters()
                load.append(round(os.getloadavg()[0], 2))
                seconds.append(round(run_batch(client, lines, settings)[0], 2))
                after = counters()
                steps.append(int(after[0] - before[0]))
                limited.append(int(after[1] - before[1]))
    return {"transcripts": len(lines), "repeats": repeats, "repeat_s": seconds, "repeat_steps": steps,
            "repeat_limited_steps": limited, "repeat_load_average": load,
            "slowest_over_fastest": round(max(seconds) / min(seconds), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transcripts", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=0,
                        help="run the batch this many times on one warm service, chats between repeats, and "
                             "report each repeat's time (the default --transcripts is then 96)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    settings = Settings()
    model = tiny_model()
    upgrade(settings.database_url.get_secret_value())
    if args.repeats:
        transcripts = 96 if args.transcripts == parser.get_default("transcripts") else args.transcripts
        report(repeated(workload(transcripts, args.max_new_tokens), settings, model, args.repeats), args.json)
        return
    lines = workload(args.transcripts, args.max_new_tokens)
    jobs = [JobIn(kind="summarize", priority=1, messages=x["transcript"], sampling={"max_new_tokens": x["max_new_tokens"]})
            for x in lines]
    engine_s, outcomes, engine_gap_ms = through_engine(jobs, settings.model_copy(update={"model": str(model)}),
                                                       threads=settings.worker_concurrency)
    engine_tokens = sum(len(o.completion.token_ids) for o in outcomes)
    service_s, service_tokens, gap_ms = through_service(lines, settings, model)
    thread_s, _, thread_gap_ms = through_service(lines, settings, model, engine_process=False)
    result = {
        "transcripts": len(lines),
        "backend": settings.backend,
        "transcripts_per_s": round(len(lines) / service_s, 2),
        "output_tok_s": round(service_tokens / service_s, 1),
        "engine_transcripts_per_s": round(len(lines) / engine_s, 2),
        "engine_output_tok_s": round(engine_tokens / engine_s, 1),
        "pipeline_vs_engine": round(engine_s / service_s, 3),
        "loop_gap_p95_ms": round(gap_ms, 3),
        "engine_loop_gap_p95_ms": round(engine_gap_ms, 3),
        "thread_transcripts_per_s": round(len(lines) / thread_s, 2),
        "thread_pipeline_vs_engine": round(engine_s / thread_s, 3),
        "thread_loop_gap_p95_ms": round(thread_gap_ms, 3),
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
