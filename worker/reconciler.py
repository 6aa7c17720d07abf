"""Nothing lost, nothing run twice: lease renewal, and the one sweep that hands back and re-sends jobs.

Each worker beats once per `heartbeat_s` (one transaction: its `workers` row, the leases of the jobs it holds,
and whether a sweep is due), so its cost is constant per worker; the beat has a thread of its own, so that no
sweep, however long, delays it. The sweep runs on one worker at a time, once per `sweep_every_s` across the
fleet (an advisory lock held for the whole sweep, then the turn in `sweeps`): it hands back jobs whose lease
expired (`attribute` decides what each crash says about each job), ends queued jobs past their deadline, folds
the status counts, prunes finished work hourly, and re-sends queued jobs only on evidence that no message for
them exists (`broker.view.BrokerView`; a published job's message must be missing at two sweeps in a row). It
works in chunks, each its own short transaction. Its cost follows the backlog, never the number of workers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis
from celery import Celery
from sqlalchemy import Row, case, or_, select, text, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Advert, Router, homes_open, shared_queues
from broker.publish import mark_published, publish
from broker.view import BrokerView
from engine.interface import FinishReason
from jobs.queues import home_tag
from jobs.schemas import JobStatus
from jobs.settings import Settings
from jobs.tables import Job, Run, Sweep, Worker, utcnow
from store.clock import db_now
from store.counts import fold
from store.retention import prune, retention_period
from store.workers import alive
from store.writes import insert_ignore
from worker.leases import Leases
from worker.results import end_runs, end_unrun, lost_run_updates, retrying, returned, settle

log = logging.getLogger(__name__)
QUEUED, RUNNING, FAILED = JobStatus.queued.value, JobStatus.running.value, JobStatus.failed.value
SWEEP, PRUNE = "reconcile", "prune"  # periodic tasks, by their row in `sweeps`
PRUNE_EVERY_S = 3600.0  # retention (CONVOQ_RETENTION_DAYS) runs once an hour, by the sweeper
SWEEP_LOCK = 0x636F6E766F71  # any constant shared by every worker: "convoq"
LOCK_IDLE_S = 60.0  # a sweeper silent this long (killed, frozen) loses the sweep's lock
CHUNK = 1000  # rows per statement: bounded transactions, and no IN list near the driver's parameter limit
# called by a sweep before each chunk: raises once the sweep may no longer go on (`sweep_lock`)
Hold = Callable[[], object] | None


def _hold(hold: Hold) -> None:
    if hold is not None:
        hold()


@dataclass
class Beat:
    """What one heartbeat learned: whether a sweep is due, and, among the jobs this worker holds, those lost
    (their lease moved on) and those whose cancel was asked for."""

    sweep_due: bool
    lost: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def usage_columns(usage: tuple[float, int] | None) -> dict:
    """A worker row's columns for its `usage` (CPU seconds, jobs finished); none when there is none."""
    return {} if usage is None else dict(cpu_s=usage[0], jobs_finished=usage[1])


def beat(sessions: sessionmaker[Session], name: str, leases: dict[uuid.UUID, uuid.UUID], lease_s: float,
         sweep_every_s: float, usage: tuple[float, int] | None = None, advert: Advert | None = None) -> Beat:
    """Stamp this worker alive and renew the leases it holds (job id -> lease id), in one transaction; with its
    `usage` so far (CPU seconds, jobs finished: `Worker.cpu_s`, `Worker.jobs_finished`) and its `advert` (the
    classes it consumes and whether it takes conversations, which the router reads)."""
    used = usage_columns(usage) | (advert.columns() if advert is not None else {})
    workers, jobs, sweeps = Worker.__table__, Job.__table__, Sweep.__table__
    swept_at = select(sweeps.c.swept_at).where(sweeps.c.name == SWEEP).scalar_subquery()
    due = case((swept_at.is_(None), True), (swept_at < db_now(-sweep_every_s), True), else_=False)
    with sessions.begin() as session:
        row = session.execute(update(workers).where(workers.c.name == name)
                              .values(heartbeat_at=db_now(), stopped_at=None, **used).returning(due)).first()
        if row is None:  # first beat (or the row was pruned while this worker was cut off)
            now = utcnow()
            insert_ignore(session, Worker, dict(name=name, hostname=socket.gethostname(), pid=os.getpid(),
                                                 started_at=now, heartbeat_at=now, **used))
        renewed: list[Row] = []
        if leases:
            renewed = session.execute(
                # An expired lease is renewed too while its job still runs under it: it expired while this worker
                # lived (the database was away, or the worker froze), and nobody else has the job. Once a sweep
                # hands the job back its lease id is gone, so is the renewal, and every late write of the run
                # is refused (`results.holds`).
                update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING,
                                   jobs.c.lease_id.in_(set(leases.values())))
                .values(lease_expires_at=db_now(lease_s))
                .returning(jobs.c.id, jobs.c.cancel_requested_at)
            ).all()
    held = {job_id for job_id, _ in renewed}
    return Beat(sweep_due=row is None or bool(row[0]),
                lost=[str(i) for i in leases if i not in held],
                cancelled=[str(i) for i, asked in renewed if asked is not None])


def hand_back(sessions: sessionmaker[Session], name: str, usage: tuple[float, int] | None = None) -> int:
    """A worker stopping cleanly returns the jobs it still holds, uncharged; a sweep sends them again. Its row
    says it stopped, with its last `usage` (as `beat` stamps it)."""
    used = usage_columns(usage)
    jobs = Job.__table__
    with sessions.begin() as session:
        back = session.execute(
            update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING)
            .values(**returned(), lease_id=None)
            .returning(jobs.c.id, jobs.c.lease_id)
        ).all()
        end_runs(session, [(job_id, lease, "returned") for job_id, lease in back])
        session.execute(update(Worker.__table__).where(Worker.name == name).values(stopped_at=db_now(), **used))
    return len(back)


def mark_draining(sessions: sessionmaker[Session], name: str) -> None:
    """This worker's shutdown has begun: from now on the router places no conversation on it (`broker.affinity`),
    and the sweep moves whatever is sent to its own queues regardless to the shared ones."""
    with sessions.begin() as session:
        session.execute(update(Worker.__table__).where(Worker.name == name, Worker.draining_at.is_(None))
                        .values(draining_at=db_now()))


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


def hand_back_expired(sessions: sessionmaker[Session], max_crashes: int, hold: Hold = None) -> Counter:
    """Hand back every running job whose lease expired, in chunks (`hold` is called before each, see
    `sweep_lock`); returns how many got each verdict."""
    jobs, runs = Job.__table__, Run.__table__
    counts: Counter = Counter()
    back, failed = lost_run_updates()
    while True:
        _hold(hold)
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

def resend(sessions: sessionmaker[Session], celery: Celery, settings: Settings, broker: BrokerView,
           router: Router, hold: Hold = None) -> tuple[list[uuid.UUID], int]:
    """Send again the queued jobs with no live message (see the module's doc), in chunks (`hold` before each);
    returns the ids sent and how many published jobs were seen without a message for the first time
    (`message_missing_at`: the next sweep, by whichever worker, sends those still missing)."""
    jobs = Job.__table__
    live = broker.live(settings.dead_after_s)  # read before the rows: a message consumed since is a running job
    grace = db_now(-settings.unpublished_grace_s)
    # Never sent, for longer than the grace: a job put back to `queued` by a writer that sends its message itself
    # (a retry's, a stall's, a shutdown's) is stamped as published then (`results.sent_on`), so it is judged from
    # that moment, and its backoff holds; one the sweep must send (its lease expired) goes at once.
    never = jobs.c.published_at.is_(None) & (jobs.c.created_at < grace)
    if live is None:  # no view into the broker: only the age of the last publish says a message was lost
        sent_long_ago = jobs.c.published_at < db_now(-settings.republish_after_s)
        with sessions() as session:
            due = list(session.scalars(select(jobs.c.id).where(jobs.c.status == QUEUED, or_(never, sent_long_ago))))
        return _send(sessions, celery, settings, broker, router, due, hold), 0
    found, reappeared, missing, due = [], [], [], []
    page = select(jobs.c.id, jobs.c.published_at, jobs.c.message_missing_at).where(
        jobs.c.status == QUEUED, or_(never, jobs.c.published_at < grace)).order_by(jobs.c.id).limit(CHUNK)
    after = None
    while True:  # a page per short read, not one read as long as the backlog
        _hold(hold)
        with sessions() as session:
            rows = session.execute(page if after is None else page.where(jobs.c.id > after)).all()
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
        if len(rows) < CHUNK:
            break
        after = rows[-1].id
    for chunk in _chunks(found):  # stamping clears `message_missing_at` too
        _hold(hold)
        with sessions() as session:
            mark_published(session, chunk)
    for ids, value in ((reappeared, None), (missing, db_now())):
        for chunk in _chunks(ids):
            _hold(hold)
            with sessions.begin() as session:
                session.execute(update(jobs).where(jobs.c.id.in_(chunk), jobs.c.status == QUEUED)
                                .values(message_missing_at=value))
    return _send(sessions, celery, settings, broker, router, due, hold), len(missing)


def _chunks(ids: list[uuid.UUID]) -> Iterator[list[uuid.UUID]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]


def _send(sessions: sessionmaker[Session], celery: Celery, settings: Settings, broker: BrokerView, router: Router,
          job_ids: list[uuid.UUID], hold: Hold) -> list[uuid.UUID]:
    sent: list[uuid.UUID] = []
    for chunk in _chunks(job_ids):
        _hold(hold)
        with sessions() as session:
            stranded = list(session.scalars(select(Job).where(Job.id.in_(chunk), Job.status == QUEUED)))
            sent += publish(celery, session, stranded, settings, router=router) if stranded else []
    broker.forget(sent)
    if job_ids:
        log.warning("reconciler: %d of %d queued jobs with no message sent again", len(sent), len(job_ids))
    return sent


def rehome_gone(sessions: sessionmaker[Session], broker: BrokerView, dead_after_s: float) -> int:
    """Move what the own queues no worker reads still hold to the shared queues: those of workers not alive,
    draining, or not consuming that class (`broker.affinity.homes_open`). The broker away moves nothing now, and
    stops nothing else of the sweep: the next one moves them."""
    with sessions() as session:
        homes = homes_open(session, dead_after_s)
    shared = shared_queues(broker.settings)
    read = {(shared[c], home_tag(h.name)) for h in homes for c in h.classes}
    try:
        rehomed = broker.rehome(lambda queue, tag: (queue, tag) not in read)
    except redis.RedisError:
        log.warning("reconciler: the broker is away; gone workers' own queues are moved at the next sweep",
                    exc_info=True)
        return 0
    if rehomed:
        log.warning("reconciler: %d messages of own queues no worker reads moved to the shared queues", rehomed)
    return rehomed


# --- the sweep ----------------------------------------------------------------------------------------------


class LockLost(RuntimeError):
    """The session that held the sweep's lock ended (idle too long, or the database went away): another worker
    may be sweeping now, so this one stops."""


@contextmanager
def sweep_lock(sessions: sessionmaker[Session]) -> Iterator[Callable[[], None] | None]:
    """The right to sweep, held for the whole sweep however long it takes: None if another process has it, else
    `hold`, which the sweep calls before each chunk.

    A session-level PostgreSQL advisory lock on a connection of its own, idle outside any transaction between
    chunks. The server ends that session once it has been idle for `LOCK_IDLE_S` (`idle_session_timeout`,
    PostgreSQL 14+), and the lock with it, so a sweeper that stops (killed, frozen) gives the lock up within a
    minute. `hold` uses the session, which keeps a working sweeper's lock from ever idling that long, and raises
    `LockLost` once it has ended: a sweeper back from a freeze finds its lock gone at its next chunk and stops, so
    at most the chunk it was in overlaps the next sweeper's (each chunk is fenced or idempotent). A lock held by a
    transaction instead sits idle in that transaction while the sweep works on other connections, and the
    server ended it after a minute however busy the sweep was: a second sweeper then ran beside the first.
    """
    engine = sessions.kw["bind"]
    if engine.dialect.name != "postgresql":  # an embedded database serves one host: nothing to share
        yield lambda: None
        return
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")  # idle between chunks, never in a transaction
        if not conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": SWEEP_LOCK}):
            yield None
            return
        try:
            conn.execute(text("SELECT set_config('idle_session_timeout', :ms, false)"),
                         {"ms": str(int(LOCK_IDLE_S * 1000))})

            def hold() -> None:
                try:
                    conn.execute(text("SELECT 1"))
                except DBAPIError as exc:
                    raise LockLost("the sweep's lock was lost; another worker may be sweeping") from exc

            yield hold
        finally:
            # unlocked now (a session's end frees the lock only once the server has noticed it), and the
            # connection closed, not pooled, with its timeout and any lock an unlock that failed left behind
            with suppress(SQLAlchemyError):  # the session is gone already: so is its lock
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": SWEEP_LOCK})
            conn.invalidate()


def take_turn(sessions: sessionmaker[Session], name: str, every_s: float) -> bool:
    """Claim the turn of the periodic task `name` in the `sweeps` table, unless its last run (by any worker) was
    less than half a period ago."""
    sweeps = Sweep.__table__
    with sessions.begin() as session:
        insert_ignore(session, Sweep, dict(name=name, swept_at=datetime(1970, 1, 1, tzinfo=UTC)))
        return session.execute(update(sweeps).where(sweeps.c.name == name, sweeps.c.swept_at < db_now(-every_s / 2))
                               .values(swept_at=db_now())).rowcount == 1


def expire_queued(sessions: sessionmaker[Session], hold: Hold = None) -> list[tuple[uuid.UUID, uuid.UUID | None]]:
    """End the queued jobs past their deadline (`end_unrun`), a chunk per transaction (`hold` before each);
    returns (job id, batch id) of each."""
    jobs = Job.__table__
    due = (select(jobs.c.id).where(jobs.c.status == QUEUED, jobs.c.deadline_at <= db_now())
           .limit(CHUNK).with_for_update(skip_locked=True))
    expired: list[tuple[uuid.UUID, uuid.UUID | None]] = []
    while True:
        _hold(hold)
        with sessions.begin() as session:
            chunk = end_unrun(session, jobs.c.id.in_(due))
        expired += chunk
        if len(chunk) < CHUNK:
            return expired


@dataclass
class Sweeper:
    sessions: sessionmaker[Session]
    celery: Celery
    settings: Settings
    router: Router = field(init=False)  # the jobs it sends again go to their conversations' workers

    def __post_init__(self) -> None:
        self.router = Router(self.settings)

    def sweep(self, force: bool = False, hand_back: bool = True) -> dict[str, int] | None:
        """One sweep if this process gets the lock and the turn (`force`: whenever it gets the lock); None if
        another worker has it. `hand_back`: whether jobs whose lease expired may be handed back now (not while
        their workers may be renewing them after an outage: `Reconciler.settled`)."""
        with sweep_lock(self.sessions) as hold:
            if hold is None or not (take_turn(self.sessions, SWEEP, self.settings.sweep_every_s) or force):
                return None
            swept = self._sweep(hold, hand_back)
            if (period := retention_period(self.settings)) and take_turn(self.sessions, PRUNE, PRUNE_EVERY_S):
                swept["pruned_jobs"] = prune(self.sessions, period, before_chunk=hold).jobs
            return swept

    def _sweep(self, hold: Hold, hand_back: bool) -> dict[str, int]:
        s, sessions = self.settings, self.sessions
        broker = BrokerView(s)
        try:
            # first, and on a read of its own: whatever of the rest fails, what waits in a gone worker's own queues
            # reaches the shared ones (and counts as live messages below, not as missing ones)
            rehomed = rehome_gone(sessions, broker, s.dead_after_s)
            verdicts = hand_back_expired(sessions, s.max_crashes, hold) if hand_back else Counter()
            expired = expire_queued(sessions, hold)
            with sessions.begin() as session:
                session.execute(update(Worker.__table__).where(Worker.stopped_at.is_(None), ~alive(s.dead_after_s))
                                .values(stopped_at=db_now()))
                fold(session)  # the status counts' deltas since the last sweep, into one row per status
            for batch_id in {b for _, b in expired if b is not None}:
                retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
            sent, missing = resend(sessions, self.celery, s, broker, self.router, hold)
        finally:
            broker.close()
        return {"handed_back": verdicts["crashed"] + verdicts["spared"], "condemned": verdicts["condemned"],
                "exhausted": verdicts["exhausted"], "expired": len(expired), "published": len(sent),
                "awaiting_confirmation": missing, "rehomed": rehomed}


class Reconciler:
    """The reconciler of one worker process, on two threads: the heartbeat beats every `heartbeat_s`, renews the
    worker's leases and stops the runs it lost or whose cancel was asked for (`stop_jobs(ids, reason)`); the
    sweeper sweeps when a beat finds its turn come. Apart, so that no sweep or prune, however long, holds a beat
    back: the leases of the sweeper's own jobs would expire under it, and charge them a crash."""

    def __init__(self, sessions: sessionmaker[Session], celery: Celery, settings: Settings, name: str,
                 leases: Leases, stop_jobs: Callable[[list[str], FinishReason], list[str]],
                 usage: Callable[[], tuple[float, int]] | None = None, advert: Advert | None = None) -> None:
        """`usage`: the worker's CPU seconds and jobs finished so far, stamped on its row at every beat, with its
        `advert` (what it consumes, for the router)."""
        self.sessions, self.settings, self.name, self.leases = sessions, settings, name, leases
        self.stop_jobs, self.usage, self.advert = stop_jobs, usage, advert
        self.sweeper = Sweeper(sessions, celery, settings)
        self._stop = threading.Event()
        self._sweep_due = threading.Event()
        # when the database last answered a beat, and since when it has answered them without a gap (monotonic)
        self._last_beat: float | None = None
        self._answering_since = 0.0
        # The longest gap between beats that no lease can expire in: a live worker renews its leases within two
        # heartbeats of the database's return. (Not under one and a half heartbeats, a beat's own cadence: a
        # lease that short expires at any late beat whatever this says.)
        self._quiet_s = max(settings.dead_after_s - 2 * settings.heartbeat_s, 1.5 * settings.heartbeat_s)
        self._beats = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._sweeps = threading.Thread(target=self._sweep_loop, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        self.beat()
        self._beats.start()
        self._sweeps.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._sweep_due.set()
        self._beats.join(10)
        # a sweep in progress is not waited for: each of its chunks is a transaction of its own, and the one it is
        # in when the process ends is rolled back
        self._sweeps.join(1)

    def beat(self) -> Beat:
        s = self.settings
        held = self.leases.held()
        result = beat(self.sessions, self.name, held, s.dead_after_s, s.sweep_every_s,
                      self.usage() if self.usage is not None else None, self.advert)
        now = time.monotonic()
        if self._last_beat is None or now - self._last_beat > self._quiet_s:  # started, or back from an outage
            self._answering_since = now
        self._last_beat = now
        # a job that finished since the leases were read is not running any more, and one claimed again here
        # since (a stalled engine's job, sent again at once) runs under a new lease: only runs still going are lost
        still = self.leases.held()
        lost = [i for i in result.lost if still.get(uuid.UUID(i)) == held[uuid.UUID(i)]]
        if lost := self.stop_jobs(lost, FinishReason.lease_lost):
            log.warning("lost the lease of %d running jobs (handed to another worker meanwhile): stopped", len(lost))
        if result.cancelled:
            self.stop_jobs(result.cancelled, FinishReason.cancelled)
        if result.sweep_due:
            self._sweep_due.set()
        return result

    def settled(self) -> bool:
        """Whether the database has answered this worker's beats without a gap for a full lease (`dead_after_s`):
        only then does a lease that expired mean that its worker stopped beating, not that the database was away.

        A database outage long enough to expire a lease expires every lease in flight, while their workers live.
        Each of them renews its own at its first beat back (an expired lease is renewed while its job still runs
        under it: `beat`); a sweeper that has seen the database answer for a full lease since has let them, and
        whatever is still expired belongs to a worker that did not beat: dead, or frozen. Such an outage leaves a
        gap of over `_quiet_s` in this worker's beats too (a beat that failed, or hung until the database came
        back), which restarts the count; a sweeper that started since cannot tell, and counts from its start. A
        beat that fails now and then (a lost connection) leaves a gap too short to restart anything."""
        now = time.monotonic()
        return (self._last_beat is not None and now - self._last_beat <= self._quiet_s
                and now - self._answering_since >= self.settings.dead_after_s)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                self.beat()
            except Exception:  # the database is away: try again next beat
                log.exception("reconciler heartbeat failed")

    def _sweep_loop(self) -> None:
        while self._sweep_due.wait() and not self._stop.is_set():
            self._sweep_due.clear()
            try:
                self.sweeper.sweep(hand_back=self.settled())
            except Exception:  # the database or broker is away, or the lock was lost: the next turn sweeps again
                log.exception("reconciler sweep failed")
