"""Nothing lost, nothing run twice: lease renewal, and the one sweep that hands back and re-sends jobs.

Each worker beats once per `heartbeat_s` (one transaction: its `workers` row, the leases of the jobs it holds,
and whether a sweep is due), so its cost is constant per worker. The sweep runs on one worker at a time, once
per `sweep_every_s` across the fleet (an advisory lock, then the turn in `sweeps`): it hands back jobs whose
lease expired (`attribute` decides what each crash says about each job), ends queued jobs past their deadline,
folds the status counts, prunes finished work hourly, and re-sends queued jobs only on evidence that no message
for them exists (`jobs.broker.BrokerView`; a published job's message must be missing at two sweeps in a row).
Its cost follows the backlog, never the number of workers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime

from celery import Celery
from sqlalchemy import Row, bindparam, case, or_, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from jobs.broker import BrokerView
from jobs.clock import db_now
from jobs.counts import fold
from jobs.db import insert_ignore
from jobs.publish import mark_published, publish
from jobs.retention import prune, retention_period
from jobs.schemas import JobStatus
from jobs.settings import Settings
from jobs.tables import Job, Run, Sweep, Worker, utcnow
from worker.leases import Leases
from worker.outcome import LEASE_LOST
from worker.results import end_runs, end_unrun, retrying, returned, settle

log = logging.getLogger(__name__)
QUEUED, RUNNING, FAILED = JobStatus.queued.value, JobStatus.running.value, JobStatus.failed.value
SWEEP, PRUNE = "reconcile", "prune"  # periodic tasks, by their row in `sweeps`
PRUNE_EVERY_S = 3600.0  # retention (CONVOQ_RETENTION_DAYS) runs once an hour, by the sweeper
SWEEP_LOCK = 0x636F6E766F71  # any constant shared by every worker: "convoq"
CHUNK = 1000  # rows per statement: bounded transactions, and no IN list near the driver's parameter limit


@dataclass
class Beat:
    """What one heartbeat learned: whether a sweep is due, and, among the jobs this worker holds, those lost
    (their lease moved on) and those whose cancel was asked for."""

    sweep_due: bool
    lost: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def beat(sessions: sessionmaker[Session], name: str, leases: dict[uuid.UUID, uuid.UUID], lease_s: float,
         sweep_every_s: float) -> Beat:
    """Stamp this worker alive and renew the leases it holds (job id -> lease id), in one transaction."""
    workers, jobs, sweeps = Worker.__table__, Job.__table__, Sweep.__table__
    swept_at = select(sweeps.c.swept_at).where(sweeps.c.name == SWEEP).scalar_subquery()
    due = case((swept_at.is_(None), True), (swept_at < db_now(-sweep_every_s), True), else_=False)
    with sessions.begin() as session:
        row = session.execute(update(workers).where(workers.c.name == name)
                              .values(heartbeat_at=db_now(), stopped_at=None).returning(due)).first()
        if row is None:  # first beat (or the row was pruned while this worker was cut off)
            now = utcnow()
            insert_ignore(session, Worker, dict(name=name, hostname=socket.gethostname(), pid=os.getpid(),
                                                 started_at=now, heartbeat_at=now))
        renewed: list[Row] = []
        if leases:
            renewed = session.execute(
                # an expired lease is not renewed, even before a sweep hands its job back
                update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING,
                                   jobs.c.lease_id.in_(set(leases.values())), jobs.c.lease_expires_at >= db_now())
                .values(lease_expires_at=db_now(lease_s))
                .returning(jobs.c.id, jobs.c.cancel_requested_at)
            ).all()
    held = {job_id for job_id, _ in renewed}
    return Beat(sweep_due=row is None or bool(row[0]),
                lost=[str(i) for i in leases if i not in held],
                cancelled=[str(i) for i, asked in renewed if asked is not None])


def hand_back(sessions: sessionmaker[Session], name: str) -> int:
    """A worker stopping cleanly returns the jobs it still holds, uncharged; a sweep sends them again."""
    jobs = Job.__table__
    with sessions.begin() as session:
        back = session.execute(
            update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING)
            .values(**returned(), lease_id=None)
            .returning(jobs.c.id, jobs.c.lease_id)
        ).all()
        end_runs(session, [(job_id, lease, "returned") for job_id, lease in back])
        session.execute(update(Worker.__table__).where(Worker.name == name).values(stopped_at=db_now()))
    return len(back)


# --- crash attribution --------------------------------------------------------------------------------------


def attribute(expired: list[Row], blamed_workers: set[str], max_crashes: int) -> dict[uuid.UUID, str]:
    """What each job whose lease expired (its worker died, froze or was cut off) becomes:
    - `condemned`: it ran alone in its worker, so the worker's end was its doing; it fails;
    - `spared`: its worker's end is blamed on a job that ran alone there; it goes back uncharged;
    - `crashed`: nothing tells which job did it; it goes back a suspect (`crashes` + 1), or
    - `exhausted`: it has now been in `max_crashes` crashes; it fails.
    `blamed_workers`: workers whose end an earlier sweep already blamed on a job that ran alone."""
    blamed = blamed_workers | {row.worker for row in expired if row.alone_at is not None}
    verdicts = {}
    for row in expired:
        if row.alone_at is not None:
            verdicts[row.id] = "condemned"
        elif row.worker in blamed:
            verdicts[row.id] = "spared"
        else:
            verdicts[row.id] = "exhausted" if row.crashes + 1 >= max_crashes else "crashed"
    return verdicts


def crash_error(verdict: str, crashes: int) -> str:
    """The error of a job failed for crashes; `crashes` counts this one."""
    if verdict == "condemned":
        return (f"its worker died while it ran alone ({crashes} worker deaths with it running): it is taken to be "
                "the cause")
    return f"workers died {crashes} times while it ran (CONVOQ_MAX_CRASHES)"


def hand_back_expired(sessions: sessionmaker[Session], max_crashes: int) -> Counter:
    """Hand back every running job whose lease expired, in chunks; returns how many got each verdict."""
    jobs, runs = Job.__table__, Run.__table__
    counts: Counter = Counter()
    fenced = (jobs.c.id == bindparam("j")) & (jobs.c.lease_id == bindparam("l")) & (jobs.c.status == RUNNING)
    back = update(jobs).where(fenced).values(**returned(crashes=bindparam("charge")), lease_id=None)
    failed = update(jobs).where(fenced).values(
        status=FAILED, error=bindparam("e"), finished_at=db_now(), lease_id=None, lease_expires_at=None,
        crashes=jobs.c.crashes + 1)
    while True:
        with sessions.begin() as session:
            expired = session.execute(
                select(jobs.c.id, jobs.c.worker, jobs.c.lease_id, jobs.c.alone_at, jobs.c.crashes, jobs.c.batch_id)
                .where(jobs.c.status == RUNNING, jobs.c.lease_expires_at < db_now())
                .order_by(jobs.c.worker).limit(CHUNK).with_for_update(skip_locked=True)
            ).all()
            if not expired:
                break
            blamed = set(session.scalars(select(runs.c.worker).where(
                runs.c.outcome == "condemned", runs.c.worker.in_({row.worker for row in expired}))))
            verdicts = attribute(expired, blamed, max_crashes)
            rows = {row.id: row for row in expired}
            back_rows = [dict(j=i, l=rows[i].lease_id, charge=int(v == "crashed"))
                         for i, v in verdicts.items() if v in ("crashed", "spared")]
            fail_rows = [dict(j=i, l=rows[i].lease_id, e=crash_error(v, rows[i].crashes + 1))
                         for i, v in verdicts.items() if v in ("condemned", "exhausted")]
            if back_rows:
                session.connection().execute(back, back_rows)
            if fail_rows:
                session.connection().execute(failed, fail_rows)
            outcome = {"condemned": "condemned", "spared": "returned", "crashed": "crashed", "exhausted": "crashed"}
            end_runs(session, [(i, rows[i].lease_id, outcome[v]) for i, v in verdicts.items()])
        counts.update(verdicts.values())
        for batch_id in {rows[f["j"]].batch_id for f in fail_rows} - {None}:
            retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
        if len(expired) < CHUNK:
            break
    if counts:
        log.warning("reconciler: leases expired: %s", dict(counts))
    return counts


# --- messages -----------------------------------------------------------------------------------------------

def resend(sessions: sessionmaker[Session], celery: Celery, settings: Settings,
           broker: BrokerView) -> tuple[list[uuid.UUID], int]:
    """Send again the queued jobs with no live message (see the module's doc); returns the ids sent and how many
    published jobs were seen without a message for the first time (`message_missing_at`: the next sweep, by
    whichever worker, sends those still missing)."""
    jobs = Job.__table__
    live = broker.live(settings.dead_after_s)  # read before the rows: a message consumed since is a running job
    grace = db_now(-settings.unpublished_grace_s)
    never = jobs.c.published_at.is_(None) & (jobs.c.created_at < grace)
    if live is None:  # no view into the broker: only the age of the last publish says a message was lost
        sent_long_ago = jobs.c.published_at < db_now(-settings.republish_after_s)
        with sessions() as session:
            due = list(session.scalars(select(jobs.c.id).where(jobs.c.status == QUEUED, or_(never, sent_long_ago))))
        return _send(sessions, celery, settings, broker, due), 0
    found, reappeared, missing, due = [], [], [], []
    with sessions() as session:
        rows = session.execute(
            select(jobs.c.id, jobs.c.published_at, jobs.c.message_missing_at)
            .where(jobs.c.status == QUEUED, or_(never, jobs.c.published_at < grace))
            .execution_options(yield_per=CHUNK))
        for job_id, published_at, missing_at in rows:
            if job_id in live:
                if published_at is None:
                    found.append(job_id)  # handed back while its message was restored to the queue
                elif missing_at is not None:
                    reappeared.append(job_id)
            elif published_at is None or missing_at is not None:
                due.append(job_id)  # never sent, or missing at an earlier sweep too
            else:
                missing.append(job_id)
    for chunk in _chunks(found):  # stamping clears `message_missing_at` too
        with sessions() as session:
            mark_published(session, chunk)
    for ids, value in ((reappeared, None), (missing, db_now())):
        for chunk in _chunks(ids):
            with sessions.begin() as session:
                session.execute(update(jobs).where(jobs.c.id.in_(chunk), jobs.c.status == QUEUED)
                                .values(message_missing_at=value))
    return _send(sessions, celery, settings, broker, due), len(missing)


def _chunks(ids: list[uuid.UUID]) -> Iterator[list[uuid.UUID]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]


def _send(sessions: sessionmaker[Session], celery: Celery, settings: Settings, broker: BrokerView,
          job_ids: list[uuid.UUID]) -> list[uuid.UUID]:
    sent: list[uuid.UUID] = []
    for chunk in _chunks(job_ids):
        with sessions() as session:
            stranded = list(session.scalars(select(Job).where(Job.id.in_(chunk), Job.status == QUEUED)))
            sent += publish(celery, session, stranded, settings) if stranded else []
    broker.forget(sent)
    if job_ids:
        log.warning("reconciler: %d of %d queued jobs with no message sent again", len(sent), len(job_ids))
    return sent


# --- the sweep ----------------------------------------------------------------------------------------------


@contextmanager
def sweep_lock(sessions: sessionmaker[Session]) -> Iterator[bool]:
    """Whether this process may sweep now: PostgreSQL's advisory lock, held by one transaction for the sweep.
    A holder that stops (killed, frozen) loses it when its connection ends or sits idle past a minute."""
    engine = sessions.kw["bind"]
    if engine.dialect.name != "postgresql":  # an embedded database serves one host: nothing to share
        yield True
        return
    with engine.connect() as conn:
        # LOCAL: for this transaction only, so the pooled connection goes back as it came
        conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = '60s'"))
        got = bool(conn.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SWEEP_LOCK}))
        try:
            yield got
        finally:
            with suppress(OperationalError):  # the server ended the idle transaction: the lock went with it
                conn.rollback()


def take_turn(sessions: sessionmaker[Session], name: str, every_s: float) -> bool:
    """Claim the turn of the periodic task `name` in the `sweeps` table, unless its last run (by any worker) was
    less than half a period ago."""
    sweeps = Sweep.__table__
    with sessions.begin() as session:
        insert_ignore(session, Sweep, dict(name=name, swept_at=datetime(1970, 1, 1, tzinfo=UTC)))
        return session.execute(update(sweeps).where(sweeps.c.name == name, sweeps.c.swept_at < db_now(-every_s / 2))
                               .values(swept_at=db_now())).rowcount == 1


@dataclass
class Sweeper:
    sessions: sessionmaker[Session]
    celery: Celery
    settings: Settings

    def sweep(self, force: bool = False) -> dict[str, int] | None:
        """One sweep if this process gets the lock and the turn (`force`: whenever it gets the lock); None if
        another worker has it."""
        with sweep_lock(self.sessions) as mine:
            if not mine or not (take_turn(self.sessions, SWEEP, self.settings.sweep_every_s) or force):
                return None
            swept = self._sweep()
            if (period := retention_period(self.settings)) and take_turn(self.sessions, PRUNE, PRUNE_EVERY_S):
                swept["pruned_jobs"] = prune(self.sessions, period).jobs
            return swept

    def _sweep(self) -> dict[str, int]:
        s, sessions = self.settings, self.sessions
        verdicts = hand_back_expired(sessions, s.max_crashes)
        with sessions.begin() as session:
            expired = end_unrun(session, Job.deadline_at <= db_now())
            session.execute(update(Worker.__table__).where(
                Worker.stopped_at.is_(None), Worker.heartbeat_at < db_now(-s.dead_after_s)).values(stopped_at=db_now()))
            fold(session)  # the status counts' deltas since the last sweep, into one row per status
        for batch_id in {b for _, b in expired if b is not None}:
            retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
        broker = BrokerView(s)
        try:
            sent, missing = resend(sessions, self.celery, s, broker)
        finally:
            broker.close()
        return {"handed_back": verdicts["crashed"] + verdicts["spared"], "condemned": verdicts["condemned"],
                "exhausted": verdicts["exhausted"], "expired": len(expired), "published": len(sent),
                "awaiting_confirmation": missing}


class Reconciler:
    """The heartbeat thread of one worker process: beats, renews its leases, stops the runs it lost or whose
    cancel was asked for (`stop_jobs(ids, reason)`), and sweeps when its turn comes."""

    def __init__(self, sessions: sessionmaker[Session], celery: Celery, settings: Settings, name: str,
                 leases: Leases, stop_jobs: Callable[[list[str], str], list[str]]) -> None:
        self.sessions, self.settings, self.name, self.leases = sessions, settings, name, leases
        self.stop_jobs = stop_jobs
        self.sweeper = Sweeper(sessions, celery, settings)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def beat(self) -> Beat:
        s = self.settings
        result = beat(self.sessions, self.name, self.leases.held(), s.dead_after_s, s.sweep_every_s)
        # a job that finished since the leases were read is not running any more: only runs still going are lost
        if lost := self.stop_jobs(result.lost, LEASE_LOST):
            log.warning("lost the lease of %d running jobs (handed to another worker meanwhile): stopped", len(lost))
        if result.cancelled:
            self.stop_jobs(result.cancelled, "cancelled")
        return result

    def _run(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                if self.beat().sweep_due:
                    self.sweeper.sweep()
            except Exception:  # the database or broker is away: try again next beat
                log.exception("reconciler beat or sweep failed")

