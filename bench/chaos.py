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
  jobs are audited with the others, and a line that never became a job counts as lost;
- `broken-worker`: a worker whose model's weights are cut short joins the fleet while messages wait: it must exit
  non-zero before it consumes anything (`broken_worker_exits`: its exit status, None if it was still alive after
  `BROKEN_WAIT_S`), and lose nothing;
- `split-fleet`: the worker is replaced by a bulk-only one (`--queues convoq.bulk`, the newest: later worker
  faults hit it) and an interactive-only one, and `SPLIT_CONVERSATIONS` conversations each get a summary (bulk)
  and, once it ran, `SPLIT_TURNS` chat turns (interactive) in the same conversation_id: every turn must reach a
  worker that reads chats, never the bulk worker's own queue: `split_turns_late` counts those not finished
  within `SPLIT_WAIT_S` (no other fault is injected meanwhile). Their jobs are audited with the others.
A fault whose turn never came (everything had finished before it) is listed in `faults_missed`.
With `--lost-reply-every N` (20), one database commit in N of the workers loses its reply (`bench.faults`)
throughout the faulty run (not with `engine-stall`: lost replies need the engine in the worker's process). A worker that dies meanwhile is restarted too.
With `--batch`, the jobs go in as the lines of one batch (uploaded before the first worker starts): bulk work,
claimed, run and stored `CONVOQ_BULK_GROUP` lines to a message, so that a fault cuts through groups.
With `--affinity`, every job has a conversation (`chaos-{i % 50}`), and the jobs are submitted in `len(faults) + 1`
waves while workers live, so that prefix affinity sends them to a worker's own queues (`broker.affinity`; with
`CONVOQ_AFFINITY_MAX_WAITING` so high that none spills to the shared queues): the first wave once the first worker
is ready (8 submissions at a time, faster than a worker runs them), each fault while its wave is going out (a
worker fault once its worker holds jobs with messages still waiting in its own queues, or once nothing more can
come before it), the next wave once a killed, deployed or frozen worker is no longer live, so that it goes to the
new worker. What the gone worker's own queues held must reach the shared queues (the sweep, or a
clean shutdown) and run once; `home_messages_at_faults` counts the messages waiting in the faulted worker's own
queues just before each worker fault. The figures come from `bench.audit` (runs, refused writes,
statuses); targets: lost, stuck, failed, duplicate_results, duplicate_executions and crashes_uncaused (crashes
charged to jobs that no worker death or repeated stall explains) all 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
import sqlalchemy as sa
from sqlalchemy.orm import Session
from tqdm import tqdm

from api.http.client import Client
from bench.audit import audit
from bench.common import batch_of, report, tiny_model
from bench.faults import lost_replies_env
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.queues import HOME_SEP, home_tag
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.status import TERMINAL, BatchStatus, JobStatus
from jobs.tables import Batch, Job
from migrations.apply import upgrade
from store.workers import live_workers

KEY = "bench-key-not-a-secret"
FAULTS = ("kill", "redis", "postgres", "freeze", "engine-stall", "api-kill-during-ingest", "deploy", "long-outage",
          "broken-worker", "split-fleet")
WORKER_FAULTS = ("kill", "freeze", "deploy", "long-outage")
LEASE_S = 5
SHUTDOWN_GRACE_S = 0  # the jobs here take under a second: any grace would let them finish, and test nothing
STOP_GRACE_S = SHUTDOWN_GRACE_S + 10
STALL_S = 4
INGEST_LINES = 1000  # enough that the kill lands while the lines are still being read
LEAVING_FAULTS = ("kill", "deploy", "freeze")  # the worker is gone afterwards: its own queues' messages must move
BROKEN_WAIT_S = 180  # a worker whose model cannot load must have exited by then (it loads nothing else)
SPLIT_CONVERSATIONS, SPLIT_TURNS = 10, 2
SPLIT_WAIT_S = 60  # a chat turn takes well under a second here: one still waiting then was sent where nobody reads


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


def is_live(db: sa.Engine, pid: int) -> bool:
    """Whether the worker process `pid` is among the live workers that publishes route to (`broker.affinity`)."""
    try:
        with Session(db) as session:
            return any(f":{pid}:" in name for name in live_workers(session, LEASE_S))
    except sa.exc.OperationalError:
        return True


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


def broken_model(model: Path, into: Path) -> Path:
    """A copy of the model's folder with its weights cut short, as a failed download or a bad image leaves it."""
    broken = Path(shutil.copytree(model, into / "broken-model", dirs_exist_ok=True))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return broken


class Chaos:
    def __init__(self, stack: Stack, pg: PostgresServer, broker: RedisServer, outage_s: float,
                 settings: Settings, model: Path) -> None:
        self.stack, self.pg, self.broker, self.outage_s, self.settings = stack, pg, broker, outage_s, settings
        self.model = model
        self.extra: list[uuid.UUID] = []  # jobs a fault submitted itself (split-fleet's conversations)
        self.broken: list[tuple[subprocess.Popen, float]] = []  # broken workers not yet gone, and their start
        self.broken_exits: list[int | None] = []  # each broken worker's exit status; None: it stayed
        self.conversation: threading.Thread | None = None  # split-fleet's conversations, sent and awaited
        self.split_late: int | None = None  # of split-fleet's chat turns, those not finished within SPLIT_WAIT_S
        self.redis = redis.Redis.from_url(broker.url)
        self.frozen: list[tuple[int, float]] = []  # (pid, when)
        self.dead: set[int] = set()  # workers killed, frozen past their leases, or exited: the crashes they explain
        self.batches: list[uuid.UUID] = []  # uploaded by `api-kill-during-ingest`, INGEST_LINES lines each
        self.ingests_cut = 0  # of those, the ones the kill caught still validating: an ingest a new API took over
        self.stranded: list[int] = []  # messages waiting in the worker's own queues at each worker fault
        self.missed: list[str] = []  # faults that found nothing to break: the run says nothing about them
        self.left: int | None = None  # the worker the last kill, deploy or freeze removed

    def keep_a_worker(self) -> None:
        if self.stack.workers[-1].poll() is not None:
            self.dead.add(self.stack.workers[-1].pid)
            self.stack.start_worker()

    def waiting(self, pid: int) -> int:
        """Messages waiting in the own queues of the worker process `pid` (`jobs.queues.home_queue`), priority
        lists included."""
        tag = home_tag(f"{socket.gethostname()}:{pid}:")
        try:
            return sum(self.redis.llen(key) for queue in (self.settings.interactive_queue, self.settings.bulk_queue)
                       for key in self.redis.scan_iter(f"{queue}{HOME_SEP}{tag}*"))
        except redis.ConnectionError:
            return 0

    def inject(self, fault: str) -> None:
        if fault in WORKER_FAULTS:
            self.stranded.append(self.waiting(self.stack.workers[-1].pid))
        if fault in LEAVING_FAULTS:
            self.left = self.stack.workers[-1].pid
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
        elif fault == "engine-stall":
            if (engine := engine_of(self.stack.workers[-1].pid)) is None:
                self.missed.append(fault)
                return
            os.kill(engine, signal.SIGSTOP)  # the worker lives on: its watchdog kills the engine, never us
        elif fault == "broken-worker":
            self.broken_worker()
        elif fault == "split-fleet":
            self.split_fleet()
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
            cut = still_validating(self.pg.url, self.batches[-1])
            self.ingests_cut += cut
            if not cut:  # the ingest had committed before the kill: nothing was taken over
                self.missed.append(fault)
            self.stack.start_api()

    def broken_worker(self) -> None:
        """A worker on a model that cannot load, started as a supervisor would; it must leave on its own
        (`watch_broken`), while the others go on."""
        env = {**self.stack.env, "CONVOQ_MODEL": str(broken_model(self.model, self.stack.logdir))}
        with open(self.stack.logdir / "broken-worker.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.broken.append((proc, time.monotonic()))

    def watch_broken(self, final: bool = False) -> None:
        """Record the exit of each broken worker that left; one still there after `BROKEN_WAIT_S` (or at the end,
        `final`) is killed and recorded as None."""
        for proc, at in list(self.broken):
            if (code := proc.poll()) is None and not (final or time.monotonic() - at > BROKEN_WAIT_S):
                continue
            if code is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.broken_exits.append(code)
            self.broken.remove((proc, at))

    def busy(self) -> bool:
        """Whether a fault is still under way: a broken worker not yet gone, or split-fleet's conversations."""
        return bool(self.broken) or self.conversing()

    def conversing(self) -> bool:
        return self.conversation is not None and self.conversation.is_alive()

    def split_fleet(self) -> None:
        """The fleet split by class, then conversations whose summary and chat turns land on different workers
        (sent from a thread of their own: the turns wait for their summaries)."""
        leaving = self.stack.workers[-1]
        os.kill(leaving.pid, signal.SIGTERM)  # a deploy of the old worker, replaced by two
        try:
            leaving.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(leaving.pid, signal.SIGKILL)
            leaving.wait()
        self.stack.start_worker("--queues", self.settings.interactive_queue)
        self.stack.start_worker("--queues", self.settings.bulk_queue)
        self.conversation = threading.Thread(target=self.converse, name="split-fleet", daemon=True)
        self.conversation.start()

    def converse(self) -> None:
        """Each conversation's summary, then once it ran its chat turns, awaited for `SPLIT_WAIT_S`: a turn sent to
        a queue nobody reads would wait there until some later fault moved it (no other fault is injected
        meanwhile)."""
        def job(k: int, kind: str, priority: int) -> JobIn:
            return JobIn(kind=kind, messages=[{"role": "user", "content": f"Customer {k}: my parcel is late."}],
                         priority=priority, sampling={"max_new_tokens": 16}, conversation_id=f"split-{k}")

        def finished(ids: list[uuid.UUID], within_s: float) -> int:
            deadline = time.monotonic() + within_s
            while (n := sum(statuses(db, ids).get(s.value, 0) for s in TERMINAL)) < len(ids) \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            return n

        db = sa.create_engine(self.pg.url)
        with Client(self.stack.api_url, KEY) as client:
            # the most urgent bulk priority: served before the backlog of bulk work
            summaries = [client.submit(job(k, "summarize", 6)).id for k in range(SPLIT_CONVERSATIONS)]
            self.extra += summaries
            finished(summaries, 300)
            turns = [client.submit(job(k, "chat", 9)).id for k in range(SPLIT_CONVERSATIONS)
                     for _ in range(SPLIT_TURNS)]
            self.extra += turns
            self.split_late = len(turns) - finished(turns, SPLIT_WAIT_S)
        db.dispose()

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


def as_batch(client: Client, db: sa.Engine, jobs: list[JobIn]) -> list[uuid.UUID]:
    """The jobs as the lines of one batch (bulk: grouped messages), once it is ingested: their job ids."""
    batch_id = client.create_batch(batch_of(jobs)).id
    while client.get_batch(batch_id).status == "validating":
        time.sleep(0.1)
    with db.connect() as conn:
        return list(conn.scalars(sa.select(Job.id).where(Job.batch_id == batch_id)))


def run(n_jobs: int, faults: list[str], model: Path, outage_s: float, timeout: float, lost_reply_every: int,
        affinity: bool, batch: bool = False) -> dict:
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
        if affinity:
            env["CONVOQ_AFFINITY_MAX_WAITING"] = "100000"  # they pile up in a worker's own queues, none spills
        settings = Settings(broker_url=broker.url, database_url=pg.url)
        db = sa.create_engine(pg.url)
        jobs = [JobIn(messages=[{"role": "user", "content": f"Refund for order {i}?"}], priority=i % 10,
                      sampling={"max_new_tokens": 16}, conversation_id=f"chaos-{i % 50}" if affinity else None)
                for i in range(n_jobs)]
        n_waves = len(faults) + 1 if affinity else 1
        waves = [jobs[n_jobs * k // n_waves:n_jobs * (k + 1) // n_waves] for k in range(n_waves)]
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-chaos-"))) as stack:
            stack.start_api()

            def submit(wave: list[JobIn]) -> list[uuid.UUID]:  # many at a time: faster than one worker runs them
                with Client(stack.api_url, KEY) as client, ThreadPoolExecutor(8) as submitters:
                    if batch:
                        return as_batch(client, db, wave)
                    return list(submitters.map(lambda job: client.submit(job).id, wave))

            # without affinity, everything waits in the shared queues before the first worker starts
            ids = [] if affinity else submit(waves.pop(0))
            sending: Future | None = None  # the wave being submitted (with affinity), while the run goes
            chaos = Chaos(stack, pg, broker, outage_s, settings, model)
            start = time.monotonic()
            stack.start_worker()
            marks = [round(n_jobs * (k + 1) / (len(faults) + 1)) for k in range(len(faults))]
            pending = list(faults)
            with tqdm(total=n_jobs, desc=f"{len(faults)} faults", file=sys.stderr) as bar, \
                    ThreadPoolExecutor(1) as sender:
                while time.monotonic() - start < timeout:
                    if sending is not None and sending.done():
                        ids, sending = ids + sending.result(), None
                    audited = ids + chaos.batch_jobs(db) + chaos.extra
                    counts = statuses(db, audited)
                    done = sum(counts.get(s.value, 0) for s in TERMINAL)
                    bar.update(done - bar.n)
                    chaos.watch_broken()
                    if done >= n_jobs + INGEST_LINES * len(chaos.batches) + len(chaos.extra) and not chaos.busy():
                        break
                    chaos.keep_a_worker()
                    injected = len(faults) - len(pending)
                    # with affinity, the next wave once the last fault is in and the worker it removed is not live
                    if (waves and sending is None and n_waves - len(waves) <= injected
                            and (chaos.left is None or not is_live(db, chaos.left))):
                        sending, chaos.left = sender.submit(submit, waves.pop(0)), None
                    if affinity:  # a fault once its wave is going out (all out, but for a worker's)
                        due = pending and n_waves - len(waves) > injected and (
                            sending is None or pending[0] in WORKER_FAULTS)
                    else:
                        due = pending and counts.get(JobStatus.succeeded.value, 0) >= marks[injected]
                    # a worker stores a batch's results together, then claims the next: kill, freeze, deploy or
                    # cut off one that holds jobs (with affinity: and has messages waiting in its own queues), or
                    # the fault tests nothing; unless nothing more comes before it (its count then says 0)
                    worker, idle = stack.workers[-1].pid, affinity and sending is None and done >= len(audited)
                    due = due and not chaos.conversing()  # nothing may move split-fleet's turns meanwhile
                    if due and (pending[0] not in WORKER_FAULTS or idle
                                or (held_by(db, worker) > 0 and (not affinity or chaos.waiting(worker) > 0))):
                        chaos.inject(pending.pop(0))
                    chaos.thaw(frozen_for_s=2 * LEASE_S)  # well past the lease: its jobs have moved on
                    time.sleep(0.2)
            elapsed = time.monotonic() - start
            chaos.missed += pending  # faults never injected: everything had finished before their turn
            chaos.watch_broken(final=True)
            chaos.thaw()
            time.sleep(LEASE_S)  # a thawed worker's late writes land (refused) before the count
            audited = ids + chaos.batch_jobs(db) + chaos.extra
            figures = audit(db, audited, chaos.redis, settings, chaos.dead)
            chaos.redis.close()
            never_jobs = INGEST_LINES * len(chaos.batches) - (len(audited) - len(ids) - len(chaos.extra))  # lines lost in an ingest
            figures["submitted"] += never_jobs
            figures["lost"] += never_jobs
        db.dispose()
    finally:
        pg.stop()
        broker.stop()
    return {**figures, "elapsed": elapsed, "ingests_cut": chaos.ingests_cut, "stranded": chaos.stranded,
            "missed": chaos.missed, "broken_exits": chaos.broken_exits, "split_late": chaos.split_late}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--faults", default="kill,redis,freeze,kill,postgres,kill",
                        help=f"comma-separated, in order, from {', '.join(FAULTS)}")
    parser.add_argument("--lost-reply-every", type=int, default=20, help="0: no commit loses its reply")
    parser.add_argument("--outage-s", type=float, default=60.0, help="how long PostgreSQL stays down")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for each run")
    parser.add_argument("--affinity", action="store_true",
                        help="jobs with conversations, submitted in waves while workers live (see above)")
    parser.add_argument("--batch", action="store_true",
                        help="the jobs as the lines of one batch: bulk work, in grouped messages (CONVOQ_BULK_GROUP)")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    if args.batch and args.affinity:
        parser.error("--batch sends its lines at once, --affinity in waves: one or the other")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}; choose from {', '.join(FAULTS)}")
    model = tiny_model()
    calm = run(args.jobs, [], model, args.outage_s, args.timeout, 0, args.affinity, args.batch)
    # lost replies are installed where the engine is built (`bench.faults`), so they need the engine in the
    # worker's process, and an engine stall needs it in a process of its own: one or the other
    lost_reply_every = 0 if "engine-stall" in faults else args.lost_reply_every
    chaos = run(args.jobs, faults, model, args.outage_s, args.timeout, lost_reply_every, args.affinity, args.batch)
    result = {
        "faults": ",".join(faults),
        "lost_reply_every": lost_reply_every,
        **{k: chaos[k] for k in ("submitted", "succeeded", "failed", "lost", "stuck", "duplicate_results",
                                 "duplicate_executions", "crashes_uncaused", "stale_writes_refused", "executions")},
        "calm_s": round(calm["elapsed"], 1),
        "chaos_s": round(chaos["elapsed"], 1),
        "ingests_cut": chaos["ingests_cut"],
        # a fault that found nothing to break passes without testing anything: this must be empty
        "faults_missed": chaos["missed"],
        **({"home_messages_at_faults": chaos["stranded"]} if args.affinity else {}),
        **({"broken_worker_exits": chaos["broken_exits"]} if "broken-worker" in faults else {}),
        **({"split_turns_late": chaos["split_late"]} if "split-fleet" in faults else {}),
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
