"""Chaos: push jobs through the service while killing the worker (`kill -9`), and count what survived.

    python -m bench.chaos --jobs 500 --kills 3 --json

Two runs of the same jobs against the configured broker and database (CONVOQ_BROKER_URL,
CONVOQ_DATABASE_URL): one undisturbed, one with `--kills` worker kills spread over the run (a new worker
is started after each). Reports submitted, succeeded, failed, duplicates (result rows beyond one per
job), lost (jobs never finished), and the extra wall time the faults cost.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from tqdm import tqdm

from api.client import Client
from bench.common import report, tiny_model
from cli.stack import Stack
from jobs.schemas import TERMINAL, JobIn, JobStatus
from jobs.settings import Settings
from jobs.tables import Job, Result
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"


def finished(db: sa.Engine, ids: list[uuid.UUID]) -> dict[str, int]:
    with db.connect() as conn:
        rows = conn.execute(sa.select(Job.status, sa.func.count()).where(Job.id.in_(ids)).group_by(Job.status)).all()
    return dict(rows)


def run(n_jobs: int, kills: int, settings: Settings, model: Path, timeout: float) -> dict:
    env = {"CONVOQ_DATABASE_URL": settings.database_url.get_secret_value(), "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(),
           "CONVOQ_MODEL": str(model), "CONVOQ_API_KEYS": KEY, "CONVOQ_HEARTBEAT_S": "1", "CONVOQ_DEAD_AFTER_S": "5",
           "CONVOQ_UNPUBLISHED_GRACE_S": "2", "CONVOQ_WORKER_CONCURRENCY": "32", "CONVOQ_MAX_BATCH_SIZE": "16"}
    db = sa.create_engine(settings.database_url.get_secret_value())
    with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-chaos-"))) as stack:
        stack.start_api()
        with Client(stack.api_url, KEY) as client:
            ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Refund for order {i}?"}],
                                       priority=i % 10, sampling={"max_new_tokens": 16})).id for i in range(n_jobs)]
        start = time.monotonic()
        stack.start_worker()
        marks = [round(n_jobs * (k + 1) / (kills + 1)) for k in range(kills)]
        with tqdm(total=n_jobs, desc=f"{kills} kills", file=sys.stderr) as bar:
            while True:
                counts = finished(db, ids)
                done = sum(counts.get(s.value, 0) for s in TERMINAL)
                bar.update(done - bar.n)
                if marks and counts.get(JobStatus.succeeded.value, 0) >= marks[0]:
                    marks.pop(0)
                    stack.kill_worker(sig=signal.SIGKILL)
                    stack.start_worker()
                if done >= n_jobs or time.monotonic() - start > timeout:
                    break
                time.sleep(0.2)
        elapsed = time.monotonic() - start
    with db.connect() as conn:
        results = conn.execute(sa.select(sa.func.count()).select_from(Result).where(Result.job_id.in_(ids))).scalar_one()
        with_result = conn.execute(sa.select(sa.func.count(sa.distinct(Result.job_id))).where(Result.job_id.in_(ids))).scalar_one()
    db.dispose()
    return {"elapsed": elapsed, "succeeded": counts.get(JobStatus.succeeded.value, 0),
            "failed": counts.get(JobStatus.failed.value, 0), "duplicates": results - with_result,
            "lost": n_jobs - sum(counts.get(s.value, 0) for s in TERMINAL)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for each run")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    settings = Settings()
    model = tiny_model()
    upgrade(settings.database_url.get_secret_value())
    calm = run(args.jobs, 0, settings, model, args.timeout)
    chaos = run(args.jobs, args.kills, settings, model, args.timeout)
    result = {
        "submitted": args.jobs,
        "succeeded": chaos["succeeded"],
        "failed": chaos["failed"],
        "duplicates": chaos["duplicates"],
        "lost": chaos["lost"],
        "extra_latency_s": round(chaos["elapsed"] - calm["elapsed"], 1),
        "calm_s": round(calm["elapsed"], 1),
        "chaos_s": round(chaos["elapsed"], 1),
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
