"""Throughput and overhead of the whole service path with the tiny model.

    python -m bench.pipeline --jobs 200 --json

Starts its own API and worker (real processes) against the configured broker and database
(CONVOQ_BROKER_URL, CONVOQ_DATABASE_URL), pushes short jobs through HTTP, and reads the timings rows back.
Overhead is what the service adds around the engine: end-to-end time minus time inside the engine. In a
burst (the default) it is mostly the wait in Redis behind the jobs ahead; `--rate` paces the submissions
below what the service can take, which shows the fixed cost of the path itself.

The same run also pushes as many no-op tasks through a bare Celery worker (`bench.celery_noop`: the same
broker, convoq's Celery settings, a task that only counts itself) in one burst, once the service has stopped.
A machine's speed varies with the hour, so the figure to judge is `capacity_ratio`: jobs/s of the service
over tasks/s of bare Celery.

Two more figures say where a job's cost goes. `engine_alone_jobs_per_s` runs the same jobs through the
worker's bridge and engine process with no broker and no database (`bench.engine_alone`): the most the
service could reach on this machine, whatever it spends around the engine. `cpu_ms_per_job` is the CPU time
each process spent during the burst divided by the jobs (`bench.cpu`: API, worker, engine, PostgreSQL, Redis
and this process, the client), and `bare_celery_cpu_ms_per_task` the same for the no-op burst.
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

from api.client import AsyncClient
from bench.common import percentile, report, tiny_model
from bench.cpu import CpuMeter, per_item_ms, service_parts, shared_parts
from bench.engine_alone import through_engine
from cli.stack import Stack
from cli.tiny_model import PRESETS
from jobs.broker import create_celery
from jobs.schemas import TERMINAL, JobIn, JobStatus
from jobs.settings import Settings
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
    """Poll the database until every job is terminal; returns when the last one finished (its `finished_at`).

    Polls five times a second: on a small machine the poll itself takes CPU from the service it measures.
    """
    mine = Job.id.in_([uuid.UUID(i) for i in ids])
    query = sa.select(sa.func.count()).where(mine, Job.status.in_(TERMINAL))
    deadline = time.monotonic() + timeout
    with tqdm(total=len(ids), desc="jobs", file=sys.stderr) as bar:
        while True:
            with engine.connect() as conn:
                done = conn.execute(query).scalar_one()
            bar.update(done - bar.n)
            if done >= len(ids):
                with engine.connect() as conn:
                    return as_utc(conn.execute(sa.select(sa.func.max(Job.finished_at)).where(mine)).scalar_one())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done}/{len(ids)} jobs finished within {timeout}s")
            time.sleep(0.2)


def bare_celery(settings: Settings, n_tasks: int, concurrency: int, logdir: Path,
                timeout: float = 300) -> tuple[float, dict[str, float]]:
    """Tasks per second of a burst of `n_tasks` no-ops through a bare Celery worker, sent from here, and the
    CPU ms per task of each part (the worker, Redis, this process)."""
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

        def burst(n: int) -> float:
            redis.delete(counter)
            start = time.monotonic()
            for _ in range(n):
                sender.send_task("bench.noop", args=[counter], queue=queue)
            while int(redis.get(counter) or 0) < n:
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"bare Celery ran {redis.get(counter)}/{n} tasks within {timeout}s")
                time.sleep(0.01)
            return time.monotonic() - start

        burst(8)  # warm-up: connections, the threads' first fetches
        meter = CpuMeter({"worker": lambda p: p.pid == proc.pid, **shared_parts()})
        meter.start()
        per_s = n_tasks / burst(n_tasks)
        return per_s, per_item_ms(meter.stop(), n_tasks)
    finally:
        proc.terminate()
        proc.wait(30)
        redis.delete(counter)


def run(n_jobs: int, max_new_tokens: int, concurrency: int, rate: float, preset: str = "tiny") -> dict:
    settings = Settings()
    model = tiny_model(preset)
    upgrade(settings.database_url.get_secret_value())
    db = sa.create_engine(settings.database_url.get_secret_value())
    env = {
        "CONVOQ_DATABASE_URL": settings.database_url.get_secret_value(),
        "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(),
        "CONVOQ_MODEL": str(model),
        "CONVOQ_API_KEYS": KEY,
    }
    jobs = [JobIn(messages=[{"role": "user", "content": f"Where is my order {i}? It is late."}], priority=i % 10,
                  sampling={"max_new_tokens": max_new_tokens}) for i in range(n_jobs)]
    logdir = Path(tempfile.mkdtemp(prefix="convoq-bench-"))
    with Stack(env, logdir) as stack:
        stack.start_api()
        stack.start_worker()
        # warm-up: the first batch and the connection pools, outside the measurement
        wait_done(db, asyncio.run(submit_all(stack.api_url, jobs[:8], concurrency)), 120)
        meter = CpuMeter(service_parts(stack.api.pid, stack.workers[0].pid))
        meter.start()
        start = datetime.now(UTC)
        ids = asyncio.run(submit_all(stack.api_url, jobs, concurrency, rate))
        submitted = datetime.now(UTC)
        end = wait_done(db, ids, 600)
        cpu = per_item_ms(meter.stop(), n_jobs)
    mine = [uuid.UUID(i) for i in ids]
    with db.connect() as conn:
        succeeded = conn.execute(
            sa.select(sa.func.count()).where(Job.id.in_(mine), Job.status == JobStatus.succeeded)
        ).scalar_one()
        timings = conn.execute(
            sa.select(Timing.queue_wait_ms, Timing.end_to_end_ms, Timing.engine_ms).where(Timing.job_id.in_(mine))
        ).all()
    db.dispose()
    noop_per_s, noop_cpu = bare_celery(settings, n_jobs, settings.worker_concurrency, logdir)
    engine_s, _, _ = through_engine(jobs, settings.model_copy(update={"model": str(model)}), settings.worker_concurrency)
    jobs_per_s = n_jobs / (end - start).total_seconds()
    waits = [t.queue_wait_ms for t in timings]
    overhead = [t.end_to_end_ms - t.engine_ms for t in timings]
    return {
        "model": preset,
        "jobs": n_jobs,
        "succeeded": succeeded,
        "jobs_per_s": round(jobs_per_s, 1),
        "bare_celery_tasks_per_s": round(noop_per_s, 1),
        "capacity_ratio": round(jobs_per_s / noop_per_s, 3),
        "engine_alone_jobs_per_s": round(n_jobs / engine_s, 1),
        "submit_per_s": round(n_jobs / (submitted - start).total_seconds(), 1),
        "queue_wait_p50_ms": round(percentile(waits, 0.5), 1),
        "queue_wait_p95_ms": round(percentile(waits, 0.95), 1),
        "overhead_p50_ms": round(statistics.median(overhead), 1),
        "overhead_p95_ms": round(percentile(overhead, 0.95), 1),
        "cpu_ms_per_job": cpu,
        "bare_celery_cpu_ms_per_task": noop_cpu,
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
