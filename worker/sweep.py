"""The one sweep of the fleet, run by one worker at a time, once per `sweep_every_s`.

An advisory lock is held for the whole sweep, and the turn is taken in `sweeps`. The sweep hands back jobs
whose lease expired (`worker.crashes`), ends queued jobs past their deadline, folds the status counts, prunes
finished work hourly, and sends again the queued jobs whose message is lost (`worker.resend`). It works in
chunks (`worker.chunks`), so its cost follows the backlog, never the number of workers.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime

from celery import Celery
from sqlalchemy import select, text, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Router
from broker.view import BrokerView
from jobs.settings import Settings
from jobs.tables import Job, Sweep, Worker
from store.clock import db_now
from store.counts import fold
from store.retention import prune, retention_period
from store.workers import alive
from store.writes import insert_ignore
from worker.chunks import CHUNK, Hold, keep_hold
from worker.claims import end_unrun
from worker.crashes import hand_back_expired
from worker.database import retrying, settle
from worker.fence import QUEUED
from worker.resend import rehome_gone, resend

SWEEP, PRUNE = "reconcile", "prune"  # periodic tasks, by their row in `sweeps`
PRUNE_EVERY_S = 3600.0  # retention (CONVOQ_RETENTION_DAYS) runs once an hour, by the sweeper
SWEEP_LOCK = 0x636F6E766F71  # any constant shared by every worker ("convoq")
LOCK_IDLE_S = 60.0  # a sweeper silent this long (killed, frozen) loses the sweep's lock


class LockLost(RuntimeError):
    """The session that held the sweep's lock ended (idle too long, or the database went away): another worker
    may be sweeping now, so this one stops."""


@contextmanager
def sweep_lock(sessions: sessionmaker[Session]) -> Iterator[Callable[[], None] | None]:
    """The right to sweep, held for the whole sweep however long it takes. Yields None if another process has
    it, else `hold`, which the sweep calls before each chunk.

    It is a session-level PostgreSQL advisory lock on a connection of its own, idle outside any transaction
    between chunks. The server ends that session once it has been idle for `LOCK_IDLE_S` (`idle_session_timeout`,
    PostgreSQL 14+), and the lock with it, so a sweeper that stops (killed, frozen) gives the lock up within a
    minute. `hold` uses the session, which keeps a working sweeper's lock from ever idling that long, and raises
    `LockLost` once the session has ended. So a sweeper back from a freeze finds its lock gone at its next chunk
    and stops, and at most the chunk it was in overlaps the next sweeper's (each chunk is fenced or idempotent).
    A lock held by a transaction instead sits idle in that transaction while the sweep works on other
    connections. The server ended it after a minute however busy the sweep was, and a second sweeper then ran
    beside the first.
    """
    engine = sessions.kw["bind"]
    if engine.dialect.name != "postgresql":  # an embedded database serves one host, so there is nothing to share
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
            with suppress(SQLAlchemyError):  # the session is gone already, and its lock with it
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
        keep_hold(hold)
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
        """One sweep if this process gets the lock and the turn; None if another worker has it. With `force`, it
        sweeps whenever it gets the lock. `hand_back` says whether jobs whose lease expired may be handed back now.
        They may not while their workers may be renewing them after an outage (`Reconciler.settled`)."""
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
            # First, and on a read of its own. Whatever of the rest fails, what waits in a gone worker's own queues
            # reaches the shared ones (and counts as live messages below, not as missing ones).
            rehomed = rehome_gone(sessions, broker, s.dead_after_s)
            verdicts = hand_back_expired(sessions, s.max_crashes, hold) if hand_back else Counter()
            expired = expire_queued(sessions, hold)
            with sessions.begin() as session:
                # a row locked by its worker's own transaction is left to a later sweep: that worker froze inside
                # its heartbeat (the server ends that transaction: `worker.context.FROZEN_TRANSACTION_S`), and
                # waiting on it would stop this sweep, and every sweep after it, for as long as it stays frozen
                gone = (select(Worker.name).where(Worker.stopped_at.is_(None), ~alive(s.dead_after_s))
                        .with_for_update(skip_locked=True))
                session.execute(update(Worker.__table__).where(Worker.name.in_(gone.scalar_subquery()))
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
