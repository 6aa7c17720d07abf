"""Throughput and overhead of the whole service path with the tiny model.

    python -m bench.pipeline --jobs 200 --json

Starts its own API and worker (real processes) against the configured broker and database
(CONVOQ_BROKER_URL, CONVOQ_DATABASE_URL), pushes short jobs through HTTP, and reads the timings rows back.
Overhead is what the service adds around the engine: end-to-end time minus time inside the engine. In a
burst (the default) it is mostly the wait in Redis behind the jobs ahead; `--rate` paces the submissions
below what the service can take, which shows the fixed cost of the path itself.

Then the same jobs go through again as the lines of one batch (`bulk_*`: uploaded, ingested, run in grouped
messages of `CONVOQ_BULK_GROUP` lines, timed from the upload to the last line's end).

The same run also pushes as many no-op tasks through a bare Celery worker (`bench.celery_noop`: the same
broker, convoq's Celery settings, a task that only counts itself) in one burst, once the service has stopped,
and runs the same jobs through the worker's bridge and engine process with no broker and no database
(`bench.engine_alone`): `engine_alone_jobs_per_s` is the most the service could reach on this machine, whatever
it spends around the engine, and `pipeline_vs_engine` the service's jobs/s over it. `cpu_bound_vs_engine` is
the most `pipeline_vs_engine` could be on this machine at the CPU the jobs cost: its cores over that CPU per job
(every part's: the engine's, the service's, the client's). A machine's speed varies with the hour, so these
figures are judged side by side from one run.

Where a job's cost goes: `cpu_ms_per_job` is the CPU time each process spent during the burst divided by the
jobs (`bench.cpu`: API, worker, engine, PostgreSQL, Redis and this process, the client), `bulk_cpu_ms_per_line`
the same for the batch, `worker_thread_cpu_ms_per_job` and `bulk_worker_thread_cpu_ms_per_line` the worker's
part of each by thread (read from its metrics, `worker.thread_cpu`: `MainThread` is Celery's event loop,
`ThreadPoolExecutor` Celery's task threads), and `bare_celery_cpu_ms_per_task` for the no-op burst;
`bare_celery_paced_cpu_ms_per_task` for the same no-ops sent at `submit_per_s`, the rate at which the service's
worker received its jobs (a Celery worker that waits for each message costs more per task than one fed a burst),
and `worker_vs_bare_celery` the worker's CPU per job over each. `statements_per_job` and
`bulk_statements_per_line` count the SQL statements the API and the worker sent meanwhile (`bench.statements`),
their heartbeats and sweeps included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from redis import Redis
from tqdm import tqdm

from api.http.client import AsyncClient, Client
from bench import statements
from bench.common import batch_of, percentile, report, scraped, tiny_model
from bench.cpu import CpuMeter, per_item_ms, service_parts, shared_parts
from bench.engine_alone import through_engine
from broker.app import create_celery
from cli.servers import free_port
from cli.stack import Stack
from cli.tiny_model import PRESETS
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.status import TERMINAL, JobStatus
from jobs.tables import Job, Timing, as_utc
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"


async def submit_all(url: str, jobs: list[JobIn], concurrency: int, rate: float = 0.0) -> list[str]:
    """Submit every job, at most `concurrency` requests in flight; with a `rate`, job i goes out at i / rate s."""
    async with AsyncClient(url, KEY) as client:
        gate = asyncio.Semaphore(concurrency)
        start = time.monotonic()

        async def one(i: int, job: JobIn) -> str:
            if rate > 0:
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            async with gate:
                return str((await client.submit(job)).id)

        return await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))


def wait_done(engine: sa.Engine, ids: list[str], timeout: float) -> datetime:
    """Poll the database until every job is terminal; returns when the last one finished (its `finished_at`)."""
    return wait_all(engine, Job.id.in_([uuid.UUID(i) for i in ids]), len(ids), timeout)


def wait_all(engine: sa.Engine, mine: sa.ColumnElement[bool], n: int, timeout: float) -> datetime:
    """`wait_done` for the `n` jobs `mine` selects.

    Polls five times a second: on a small machine the poll itself takes CPU from the service it measures.
    """
    query = sa.select(sa.func.count()).where(mine, Job.status.in_(TERMINAL))
    deadline = time.monotonic() + timeout
    with tqdm(total=n, desc="jobs", file=sys.stderr) as bar:
        while True:
            with engine.connect() as conn:
                done = conn.execute(query).scalar_one()
            bar.update(done - bar.n)
            if done >= n:
                with engine.connect() as conn:
                    return as_utc(conn.execute(sa.select(sa.func.max(Job.finished_at)).where(mine)).scalar_one())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done}/{n} jobs finished within {timeout}s")
            time.sleep(0.2)


def bare_celery(settings: Settings, n_tasks: int, concurrency: int, logdir: Path, rates: list[float],
                timeout: float = 300) -> tuple[float, list[dict[str, float]]]:
    """Tasks per second of a burst of `n_tasks` no-ops through a bare Celery worker, sent from here, and the
    CPU ms per task of each part (the worker, Redis, this process): sent all at once, then at each of `rates`
    (tasks per second). A Celery worker's cost per task depends on how its messages arrive: one that waits for
    each message pays a wake-up and a new fetch for it, where a burst finds the next one already there."""
    queue = f"bench-noop-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(), "CONVOQ_INTERACTIVE_QUEUE": queue,
           "CONVOQ_BULK_QUEUE": f"{queue}-bulk"}
    log = logdir / "noop-worker.log"
    sender = create_celery(settings.model_copy(update={"interactive_queue": queue, "bulk_queue": f"{queue}-bulk"}))
    redis = Redis.from_url(settings.broker_url.get_secret_value())
    counter = f"{queue}:done"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.celery_noop", "worker", "--pool=threads",
                                 f"--concurrency={concurrency}", f"--queues={queue}", "--without-mingle",
                                 "--without-gossip", "--loglevel=info"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bare Celery worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)

        def burst(n: int, rate: float = 0.0) -> float:
            redis.delete(counter)
            start = time.monotonic()
            for i in range(n):
                if rate > 0:
                    time.sleep(max(0.0, start + i / rate - time.monotonic()))
                sender.send_task("bench.noop", args=[counter], queue=queue)
            while int(redis.get(counter) or 0) < n:
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"bare Celery ran {redis.get(counter)}/{n} tasks within {timeout}s")
                time.sleep(0.01)
            return time.monotonic() - start

        burst(8)  # warm-up: connections, the threads' first fetches
        meter = CpuMeter({"worker": lambda p: p.pid == proc.pid, **shared_parts()})

        def metered(rate: float) -> tuple[float, dict[str, float]]:
            meter.start()
            seconds = burst(n_tasks, rate)
            return n_tasks / seconds, per_item_ms(meter.stop(), n_tasks)

        per_s, cpu = metered(0.0)
        return per_s, [cpu, *(metered(rate)[1] for rate in rates)]
    finally:
        proc.terminate()
        proc.wait(30)
        redis.delete(counter)


def thread_cpu_s(metrics_url: str) -> dict[str, float]:
    """The worker's CPU seconds by thread label so far, from its Prometheus metrics (`worker.thread_cpu`)."""
    return {dict(labels)["thread"]: s for labels, s in
            scraped(metrics_url, "convoq_worker_thread_cpu_seconds_total").items()}


class Burst:
    """The CPU time of each part, of the worker's threads, and the statements counted between `start` and `stop`,
    per item."""

    def __init__(self, stack: Stack, counts: Path, metrics_url: str) -> None:
        self.meter = CpuMeter(service_parts(stack.api.pid, stack.workers[0].pid))
        self.counts = counts
        self.metrics_url = metrics_url

    def start(self) -> None:
        self.statements = statements.total(self.counts)
        self.threads = thread_cpu_s(self.metrics_url)
        self.meter.start()

    def stop(self, n: int) -> tuple[dict[str, float], dict[str, float], float]:
        cpu = per_item_ms(self.meter.stop(), n)
        threads = thread_cpu_s(self.metrics_url)
        spent = {label: s - self.threads.get(label, 0.0) for label, s in threads.items()}
        # the threads that spent a part worth showing, most first; the rest summed up
        shown = {label: s for label, s in sorted(spent.items(), key=lambda kv: -kv[1]) if s * 1e3 / n >= 0.01}
        shown["others"] = sum(spent.values()) - sum(shown.values())
        time.sleep(0.3)  # the processes' last counts reach their files
        return cpu, per_item_ms(shown, n), round((statements.total(self.counts) - self.statements) / n, 2)


def run(n_jobs: int, max_new_tokens: int, concurrency: int, rate: float, preset: str = "tiny") -> dict:
    settings = Settings()
    model = tiny_model(preset)
    upgrade(settings.database_url.get_secret_value())
    db = sa.create_engine(settings.database_url.get_secret_value())
    logdir = Path(tempfile.mkdtemp(prefix="convoq-bench-"))
    counts = logdir / "statements"
    metrics_port = free_port()
    env = {
        **statements.counting_env(counts),
        "CONVOQ_DATABASE_URL": settings.database_url.get_secret_value(),
        "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(),
        "CONVOQ_MODEL": str(model),
        "CONVOQ_API_KEYS": KEY,
        "CONVOQ_WORKER_METRICS_PORT": str(metrics_port),
        # the worker's figures are read before and after each burst, a few seconds long: fresh each time
        "CONVOQ_METRICS_REFRESH_S": "0.2",
    }
    jobs = [JobIn(messages=[{"role": "user", "content": f"Where is my order {i}? It is late."}], priority=i % 10,
                  sampling={"max_new_tokens": max_new_tokens}) for i in range(n_jobs)]
    with Stack(env, logdir) as stack:
        stack.start_api()
        stack.start_worker()
        # warm-up: the first batch and the connection pools, outside the measurement
        wait_done(db, asyncio.run(submit_all(stack.api_url, jobs[:8], concurrency)), 120)
        burst = Burst(stack, counts, f"http://127.0.0.1:{metrics_port}/metrics")
        burst.start()
        start = datetime.now(UTC)
        ids = asyncio.run(submit_all(stack.api_url, jobs, concurrency, rate))
        submitted = datetime.now(UTC)
        end = wait_done(db, ids, 600)
        cpu, threads, per_job = burst.stop(n_jobs)
        burst.start()
        bulk_start = datetime.now(UTC)
        with Client(stack.api_url, KEY) as client:
            batch_id = client.create_batch(batch_of(jobs)).id
        bulk_end = wait_all(db, Job.batch_id == batch_id, n_jobs, 600)
        bulk_cpu, bulk_threads, per_line = burst.stop(n_jobs)
    mine = [uuid.UUID(i) for i in ids]
    with db.connect() as conn:
        succeeded = conn.execute(
            sa.select(sa.func.count()).where(Job.id.in_(mine), Job.status == JobStatus.succeeded)
        ).scalar_one()
        timings = conn.execute(
            sa.select(Timing.queue_wait_ms, Timing.end_to_end_ms, Timing.engine_ms).where(Timing.job_id.in_(mine))
        ).all()
    db.dispose()
    submit_per_s = n_jobs / (submitted - start).total_seconds()
    # the service's worker received its jobs' messages as fast as they were submitted: bare Celery, the same way
    noop_per_s, (noop_cpu, paced_cpu) = bare_celery(settings, n_jobs, settings.worker_concurrency, logdir,
                                                    [submit_per_s])
    engine_s, _, _ = through_engine(jobs, settings.model_copy(update={"model": str(model)}), settings.worker_concurrency)
    jobs_per_s = n_jobs / (end - start).total_seconds()
    engine_per_s = n_jobs / engine_s
    waits = [t.queue_wait_ms for t in timings]
    overhead = [t.end_to_end_ms - t.engine_ms for t in timings]
    return {
        "model": preset,
        "jobs": n_jobs,
        "succeeded": succeeded,
        "jobs_per_s": round(jobs_per_s, 1),
        "bulk_lines_per_s": round(n_jobs / (bulk_end - bulk_start).total_seconds(), 1),
        "bare_celery_tasks_per_s": round(noop_per_s, 1),
        "engine_alone_jobs_per_s": round(engine_per_s, 1),
        "pipeline_vs_engine": round(jobs_per_s / engine_per_s, 3),
        # the most the machine's cores allow at the CPU the jobs cost (every part's, the client's included) over
        # the engine alone: where `pipeline_vs_engine` stops, however the parts share the cores
        "cpu_bound_vs_engine": round(len(os.sched_getaffinity(0)) * 1e3 / cpu["total"] / engine_per_s, 3),
        "bulk_vs_engine": round(n_jobs / (bulk_end - bulk_start).total_seconds() / engine_per_s, 3),
        "submit_per_s": round(submit_per_s, 1),
        "queue_wait_p50_ms": round(percentile(waits, 0.5), 1),
        "queue_wait_p95_ms": round(percentile(waits, 0.95), 1),
        "overhead_p50_ms": round(statistics.median(overhead), 1),
        "overhead_p95_ms": round(percentile(overhead, 0.95), 1),
        "cpu_ms_per_job": cpu,
        "bulk_cpu_ms_per_line": bulk_cpu,
        # the worker's part of each, by thread (`worker.thread_cpu`: MainThread is Celery's event loop)
        "worker_thread_cpu_ms_per_job": threads,
        "bulk_worker_thread_cpu_ms_per_line": bulk_threads,
        "bare_celery_cpu_ms_per_task": noop_cpu,
        "bare_celery_paced_cpu_ms_per_task": paced_cpu,
        # the measure: the worker's CPU per interactive job over a bare Celery task's, sent all at once and
        # sent at the rate the service's jobs were
        "worker_vs_bare_celery": {"burst": round(cpu["worker"] / noop_cpu["worker"], 2),
                                  "paced": round(cpu["worker"] / paced_cpu["worker"], 2)},
        "statements_per_job": per_job,
        "bulk_statements_per_line": per_line,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight while submitting")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="jobs per second to submit at (default: all at once, a burst)")
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS),
                        help="the tiny-model preset to run (micro: the engine's compute all but out of the way)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    result = run(args.jobs, args.max_new_tokens, args.concurrency, args.rate, args.model)
    report(result, args.json)


if __name__ == "__main__":
    main()
