"""Chaos: push jobs through the service while breaking it, and count from the records what survived.

    python -m bench.chaos --jobs 300 --faults kill,redis,freeze,kill,postgres,kill --json

The service runs on a Redis (append-only file synced every second) and a PostgreSQL of its own, so that they
can be broken. Two runs of the same jobs: one undisturbed, one with the `--faults` spread evenly over the run
(each when that share of the jobs has succeeded):
- `kill`: `kill -9` of the worker; a fresh worker is started, as a supervisor would;
- `redis`: SIGKILL of Redis (up to a second of writes lost), restarted after 2 s;
- `postgres`: PostgreSQL stopped in immediate mode for `--outage-s` (60 s: longer than the lease);
- `long-outage`: PostgreSQL stopped in immediate mode for three leases while jobs run: their workers live, so
  nothing may be charged a crash;
- `deploy`: SIGTERM to the worker holding jobs, SIGKILL if it has not left `STOP_GRACE_S` later (compose's
  `stop_grace_period`), and a new worker started, as compose or a supervisor would: what the old one did not
  finish within its `CONVOQ_SHUTDOWN_GRACE_S` (none here: every job in flight) must go back uncharged and run
  once more;
- `freeze`: SIGSTOP of the worker past its lease while a fresh worker takes over; resumed afterwards, its
  late writes must be refused;
- `engine-stall`: SIGSTOP of the worker's engine process (its child) with jobs left for it: the watchdog must kill
  it and start a new one within `CONVOQ_ENGINE_STALL_S` (4 s here), and its jobs run again, charged nothing;
- `api-kill-during-ingest`: a batch of `INGEST_LINES` lines uploaded and the API SIGKILLed right after its 202,
  mid-ingest; a new API process is started, as a supervisor would, and must take the ingest over. The batch's
  jobs are audited with the others, and a line that never became a job counts as lost.
With `--lost-reply-every N` (20), one database commit in N of the workers loses its reply (`bench.faults`)
throughout the faulty run (not with `engine-stall`: lost replies need the engine in the worker's process). A worker that dies meanwhile is restarted too. The figures come from `bench.audit` (runs, refused writes,
statuses); targets: lost, stuck, failed, duplicate_results, duplicate_executions and crashes_uncaused (crashes
charged to jobs that no worker death or repeated stall explains) all 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis
import sqlalchemy as sa
from tqdm import tqdm

from api.client import Client
from bench.audit import audit
from bench.common import report, tiny_model
from bench.faults import lost_replies_env
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.schemas import TERMINAL, BatchStatus, JobIn, JobStatus
from jobs.settings import Settings
from jobs.tables import Batch, Job
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"
FAULTS = ("kill", "redis", "postgres", "freeze", "engine-stall", "api-kill-during-ingest", "deploy", "long-outage")
WORKER_FAULTS = ("kill", "freeze", "deploy", "long-outage")
LEASE_S = 5
SHUTDOWN_GRACE_S = 0  # the jobs here take under a second: any grace would let them finish, and test nothing
STOP_GRACE_S = SHUTDOWN_GRACE_S + 10
STALL_S = 4
INGEST_LINES = 1000  # enough that the kill lands while the lines are still being read


def statuses(db: sa.Engine, ids: list[uuid.UUID]) -> dict[str, int]:
    try:
        with db.connect() as conn:
            return dict(conn.execute(sa.text("SELECT status, count(*) FROM jobs WHERE id = ANY(:ids) GROUP BY status"),
                                     {"ids": ids}).all())
    except sa.exc.OperationalError:  # the database may be the thing that is down
        return {}


def held_by(db: sa.Engine, pid: int) -> int:
    """Jobs the worker process `pid` runs now (worker names are host:pid:start)."""
    try:
        with db.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status = 'running' AND worker LIKE :w"),
                                {"w": f"%:{pid}:%"}).scalar_one()
    except sa.exc.OperationalError:
        return 0


def still_validating(url: str, batch_id: uuid.UUID) -> bool:
    """Whether the batch's lines are still being read (its ingest has not committed)."""
    db = sa.create_engine(url)
    with db.connect() as conn:
        status = conn.execute(sa.select(Batch.status).where(Batch.id == batch_id)).scalar_one()
    db.dispose()
    return status == BatchStatus.validating.value


def engine_of(worker_pid: int) -> int | None:
    """The engine process of a worker: its child started by multiprocessing's spawn (not its resource tracker)."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == worker_pid and b"spawn_main" in cmdline:
            return int(entry.name)
    return None


class Chaos:
    def __init__(self, stack: Stack, pg: PostgresServer, broker: RedisServer, outage_s: float) -> None:
        self.stack, self.pg, self.broker, self.outage_s = stack, pg, broker, outage_s
        self.frozen: list[tuple[int, float]] = []  # (pid, when)
        self.dead: set[int] = set()  # workers killed, frozen past their leases, or exited: the crashes they explain
        self.batches: list[uuid.UUID] = []  # uploaded by `api-kill-during-ingest`, INGEST_LINES lines each
        self.ingests_cut = 0  # of those, the ones the kill caught still validating: an ingest a new API took over

    def keep_a_worker(self) -> None:
        if self.stack.workers[-1].poll() is not None:
            self.dead.add(self.stack.workers[-1].pid)
            self.stack.start_worker()

    def inject(self, fault: str) -> None:
        if fault == "kill":
            self.dead.add(self.stack.workers[-1].pid)
            self.stack.kill_worker(sig=signal.SIGKILL)
            self.stack.start_worker()
        elif fault == "redis":
            self.broker.kill()
            time.sleep(2)
            self.broker.start()
        elif fault in ("postgres", "long-outage"):
            self.pg.stop(remove=False, immediate=True)
            time.sleep(self.outage_s if fault == "postgres" else 3 * LEASE_S)
            self.pg.start()
        elif fault == "deploy":  # not a death: the jobs it charges are `crashes_uncaused`
            leaving = self.stack.workers[-1]
            os.kill(leaving.pid, signal.SIGTERM)  # to the worker alone, as compose signals a container's first process
            try:
                leaving.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(leaving.pid, signal.SIGKILL)
                leaving.wait()
            self.stack.start_worker()
        elif fault == "freeze":
            frozen = self.stack.workers[-1]
            os.killpg(frozen.pid, signal.SIGSTOP)
            self.frozen.append((frozen.pid, time.monotonic()))
            self.dead.add(frozen.pid)
            self.stack.start_worker()  # the frozen one stays in `workers`: keep_a_worker watches the newest
        elif fault == "engine-stall" and (engine := engine_of(self.stack.workers[-1].pid)) is not None:
            os.kill(engine, signal.SIGSTOP)  # the worker lives on: its watchdog kills the engine, never us
        elif fault == "api-kill-during-ingest":
            lines = b"".join(json.dumps({"custom_id": f"b{i}", "max_new_tokens": 16,
                                         "messages": [{"role": "user", "content": f"Invoice {i}?"}]}).encode() + b"\n"
                             for i in range(INGEST_LINES))
            answer = httpx.post(f"{self.stack.api_url}/v1/batches", files={"file": ("chaos.jsonl", lines)},
                                headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            os.killpg(self.stack.api.pid, signal.SIGKILL)
            self.stack.api.wait()
            answer.raise_for_status()
            self.batches.append(uuid.UUID(answer.json()["id"]))
            self.ingests_cut += still_validating(self.pg.url, self.batches[-1])
            self.stack.start_api()

    def batch_jobs(self, db: sa.Engine) -> list[uuid.UUID]:
        """The jobs the uploaded batches' lines have become so far (none before a batch's ingest committed)."""
        try:
            with db.connect() as conn:
                return list(conn.execute(sa.select(Job.id).where(Job.batch_id.in_(self.batches))).scalars())
        except sa.exc.OperationalError:  # the database may be the thing that is down
            return []

    def thaw(self, frozen_for_s: float = 0.0) -> None:
        """Resume the workers frozen at least `frozen_for_s` ago."""
        now = time.monotonic()
        for pid, at in [f for f in self.frozen if now - f[1] >= frozen_for_s]:
            os.killpg(pid, signal.SIGCONT)
            self.frozen.remove((pid, at))


def run(n_jobs: int, faults: list[str], model: Path, outage_s: float, timeout: float, lost_reply_every: int) -> dict:
    pg, broker = PostgresServer().start(), RedisServer().start()
    try:
        upgrade(pg.url)
        env = {"CONVOQ_DATABASE_URL": pg.url, "CONVOQ_BROKER_URL": broker.url, "CONVOQ_MODEL": str(model),
               "CONVOQ_API_KEYS": KEY, "CONVOQ_HEARTBEAT_S": "1", "CONVOQ_DEAD_AFTER_S": str(LEASE_S),
               "CONVOQ_SWEEP_EVERY_S": "2", "CONVOQ_UNPUBLISHED_GRACE_S": "2", "CONVOQ_WORKER_CONCURRENCY": "32",
               "CONVOQ_MAX_BATCH_SIZE": "16", "CONVOQ_WORKER_METRICS_PORT": "0", "CONVOQ_ENGINE_STALL_S": str(STALL_S),
               "CONVOQ_SHUTDOWN_GRACE_S": str(SHUTDOWN_GRACE_S)}
        if lost_reply_every:
            env |= lost_replies_env(lost_reply_every)
        db = sa.create_engine(pg.url)
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-chaos-"))) as stack:
            stack.start_api()
            with Client(stack.api_url, KEY) as client:
                ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Refund for order {i}?"}],
                                           priority=i % 10, sampling={"max_new_tokens": 16})).id
                       for i in range(n_jobs)]
            chaos = Chaos(stack, pg, broker, outage_s)
            start = time.monotonic()
            stack.start_worker()
            marks = [round(n_jobs * (k + 1) / (len(faults) + 1)) for k in range(len(faults))]
            pending = list(faults)
            with tqdm(total=n_jobs, desc=f"{len(faults)} faults", file=sys.stderr) as bar:
                while time.monotonic() - start < timeout:
                    audited = ids + chaos.batch_jobs(db)
                    counts = statuses(db, audited)
                    done = sum(counts.get(s.value, 0) for s in TERMINAL)
                    bar.update(done - bar.n)
                    if done >= n_jobs + INGEST_LINES * len(chaos.batches):
                        break
                    chaos.keep_a_worker()
                    due = pending and counts.get(JobStatus.succeeded.value, 0) >= marks[len(faults) - len(pending)]
                    # a worker stores a batch's results together, then claims the next: kill, freeze, deploy or
                    # cut off one that holds jobs, or the fault tests nothing
                    if due and (pending[0] not in WORKER_FAULTS or held_by(db, stack.workers[-1].pid) > 0):
                        chaos.inject(pending.pop(0))
                    chaos.thaw(frozen_for_s=2 * LEASE_S)  # well past the lease: its jobs have moved on
                    time.sleep(0.2)
            elapsed = time.monotonic() - start
            chaos.thaw()
            time.sleep(LEASE_S)  # a thawed worker's late writes land (refused) before the count
            client = redis.Redis.from_url(broker.url)
            audited = ids + chaos.batch_jobs(db)
            figures = audit(db, audited, client, Settings(broker_url=broker.url, database_url=pg.url), chaos.dead)
            client.close()
            never_jobs = INGEST_LINES * len(chaos.batches) - (len(audited) - len(ids))  # lines lost in an ingest
            figures["submitted"] += never_jobs
            figures["lost"] += never_jobs
        db.dispose()
    finally:
        pg.stop()
        broker.stop()
    return {**figures, "elapsed": elapsed, "ingests_cut": chaos.ingests_cut}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--faults", default="kill,redis,freeze,kill,postgres,kill",
                        help=f"comma-separated, in order, from {', '.join(FAULTS)}")
    parser.add_argument("--lost-reply-every", type=int, default=20, help="0: no commit loses its reply")
    parser.add_argument("--outage-s", type=float, default=60.0, help="how long PostgreSQL stays down")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for each run")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}; choose from {', '.join(FAULTS)}")
    model = tiny_model()
    calm = run(args.jobs, [], model, args.outage_s, args.timeout, 0)
    # lost replies are installed where the engine is built (`bench.faults`), so they need the engine in the
    # worker's process, and an engine stall needs it in a process of its own: one or the other
    lost_reply_every = 0 if "engine-stall" in faults else args.lost_reply_every
    chaos = run(args.jobs, faults, model, args.outage_s, args.timeout, lost_reply_every)
    result = {
        "faults": ",".join(faults),
        "lost_reply_every": lost_reply_every,
        **{k: chaos[k] for k in ("submitted", "succeeded", "failed", "lost", "stuck", "duplicate_results",
                                 "duplicate_executions", "crashes_uncaused", "stale_writes_refused", "executions")},
        "calm_s": round(calm["elapsed"], 1),
        "chaos_s": round(chaos["elapsed"], 1),
        "ingests_cut": chaos["ingests_cut"],
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
