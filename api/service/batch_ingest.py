"""A new batch's lines becoming jobs, by whichever API process holds the batch's ingest lease.

What an ingest needs is stored: the batch row (owner, priority, window) and the file its lines are read from
(`Batch.source_file_id`, a chunk at a time). The process that stored a batch ingests it at once, under the lease
it took with it; every API process also runs `Ingests`, which renews the leases of its own ingests and takes over
the batches whose lease expired (their process died, or lost the database, mid-ingest).

One transaction per ingest, not one per chunk of lines: the jobs, the line errors and the batch's move out of
`validating` commit together. So a resumed ingest starts from a clean slate (nothing half-done to find and
skip), the reconciler never sees (and publishes) the jobs of a batch still validating, and a cancel either comes
first (nothing was committed) or finds every job. The price: an ingest cut off near its end is read again in
full, seconds for the largest batch. The inserts are idempotent besides (jobs unique per (batch_id, custom_id),
line errors per (batch_id, line)) and the batch's move is fenced by the lease's token and only from
`validating`, so an ingest that lost its lease while it still ran (frozen, cut off) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from celery import Celery
from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from api.service.batch_input import LineError, ParsedLine, parse_lines
from api.service.file_store import pieces
from api.service.files import UPLOAD_PURPOSE
from api.service.prompt_check import PromptCheck
from broker.affinity import Router
from broker.publish import publish
from jobs.settings import Settings
from jobs.status import BatchStatus
from jobs.structured import SchemaBounds
from jobs.tables import Batch, BatchLineError, File, Job, job_row, utcnow
from store.clock import db_now
from store.writes import copy_ignore, insert_ignore

log = logging.getLogger(__name__)

INSERT_ROWS = 1000  # job and line-error rows per INSERT
PUBLISH_PAGE = 4096  # jobs read and published at a time: whole groups of any `bulk_group` up to 256
MAX_FAILURES = 3  # ingests of a batch that raised (not those that died with their process) before it fails
MAX_MESSAGE = 2000  # characters of a line error's reason
VALIDATING = BatchStatus.validating.value


@dataclass(frozen=True)
class Needs:
    """What an ingest works with, in the process that runs it."""

    sessions: sessionmaker[Session]
    celery: Celery
    settings: Settings
    check: PromptCheck
    router: Router | None = None


def run_ingest(needs: Needs, batch_id: uuid.UUID, lease: uuid.UUID) -> None:
    """Ingest the batch under `lease`; an ingest that raised is counted (`failed`), never raised further."""
    try:
        ingest(needs.sessions, needs.celery, needs.settings, needs.check, batch_id, lease, needs.router)
    except Exception as exc:
        # a database error too (a statement timeout, a full disk) is counted, or it would come back at every try;
        # one that leaves the database unreachable cannot be, and the batch is tried again once it is back
        log.exception("ingest of batch %s failed", batch_id)
        try:
            failed(needs.sessions, batch_id, lease, exc)
        except Exception:  # not counted: the lease lapses all the same, and the batch is tried again
            log.exception("could not count the failed ingest of batch %s", batch_id)


class Runner(Protocol):
    """Where ingests run: `submit` starts one (`run_ingest`) and gives its future, `shutdown` waits for those
    under way and drops those not started."""

    def submit(self, batch_id: uuid.UUID, lease: uuid.UUID) -> Future: ...

    def shutdown(self) -> None: ...


class OnThreads:
    """Ingests on threads of this process: an app that tests build, many to a process. An API process ingests in
    a child process instead (`api.service.ingest_process`), so that its requests never wait behind the lines'
    work for the interpreter's lock."""

    def __init__(self, needs: Needs, threads: int) -> None:
        self.needs = needs
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ingest")

    def submit(self, batch_id: uuid.UUID, lease: uuid.UUID) -> Future:
        return self._pool.submit(run_ingest, self.needs, batch_id, lease)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Ingests:
    """This process's ingests, `slots` at a time on its runner, and the resumer: every `CONVOQ_HEARTBEAT_S` it
    renews their leases (`CONVOQ_DEAD_AFTER_S` ahead, on the database's clock) and claims batches whose lease
    expired, while a slot is free. It runs on a thread, off the event loop."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings, runner: Runner, slots: int) -> None:
        self.sessions, self.settings, self.runner, self.slots = sessions, settings, runner, slots
        self._held: dict[uuid.UUID, uuid.UUID] = {}  # lease -> batch id, for each ingest submitted here
        self._lock = threading.Lock()
        self._closing = threading.Event()  # no more claims
        self._done = threading.Event()  # no more renewals
        self._resumer: threading.Thread | None = None

    def start(self) -> None:
        self._resumer = threading.Thread(target=self._resume, name="ingest-resumer", daemon=True)
        self._resumer.start()

    def stop(self) -> None:
        """Finish the ingests under way, their leases renewed meanwhile; those not started are left to lapse."""
        self._closing.set()
        self.runner.shutdown()
        self._done.set()
        if self._resumer is not None:
            self._resumer.join()

    def submit(self, batch_id: uuid.UUID, lease: uuid.UUID) -> None:
        """Ingest the batch under `lease`, which this process holds."""
        with self._lock:
            self._held[lease] = batch_id
        try:
            self.runner.submit(batch_id, lease).add_done_callback(lambda _: self._let_go(lease))
        except RuntimeError:  # shutting down: the lease lapses and another process takes the batch over
            self._let_go(lease)
            log.warning("batch %s is left to another API process: this one is stopping", batch_id)

    def _let_go(self, lease: uuid.UUID) -> None:
        with self._lock:
            self._held.pop(lease, None)

    def _resume(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # the database may be away: the next tick tries again
                log.exception("the ingest resumer's tick failed")
            if self._done.wait(self.settings.heartbeat_s):
                return

    def tick(self) -> None:
        """Renew this process's leases, then claim lapsed ones while a slot is free."""
        with self._lock:
            held = dict(self._held)
        lease_s = self.settings.dead_after_s
        with self.sessions() as session:
            if held:
                session.execute(update(Batch).where(Batch.id.in_(held.values()), Batch.ingest_lease_id.in_(held))
                                .values(ingest_lease_expires_at=db_now(lease_s)))
                session.commit()
            free = 0 if self._closing.is_set() else self.slots - len(held)
            claimed = claim_lapsed(session, free, lease_s)
        for batch_id, lease in claimed:
            log.info("resuming the ingest of batch %s", batch_id)
            self.submit(batch_id, lease)


def claim_lapsed(session: Session, n: int, lease_s: float) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """Take up to `n` batches whose ingest lease expired (or never was), each under a new lease; (batch, lease)
    of each. A conditional update per batch: of several processes claiming at once, one gets it."""
    if n <= 0:
        return []
    lapsed = Batch.source_file_id.is_not(None) & or_(Batch.ingest_lease_expires_at.is_(None),
                                                      Batch.ingest_lease_expires_at < db_now())
    claimed = []
    for batch_id in session.scalars(select(Batch.id).where(lapsed).order_by(Batch.created_at).limit(n)).all():
        lease = uuid.uuid4()
        taken = session.execute(update(Batch).where(Batch.id == batch_id, lapsed)
                                .values(ingest_lease_id=lease, ingest_lease_expires_at=db_now(lease_s)))
        if taken.rowcount:
            claimed.append((batch_id, lease))
    session.commit()
    return claimed


def ingest(sessions: sessionmaker[Session], celery: Celery, settings: Settings, check: PromptCheck,
           batch_id: uuid.UUID, lease: uuid.UUID, router: Router | None = None) -> None:
    """Read the batch's stored lines one by one, create a job per good line and a line error per bad one, move the
    batch on and publish its jobs: if it still holds `lease`. A batch cancelled while validating runs nothing."""
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.ingest_lease_id != lease or batch.source_file_id is None:
            return  # deleted, taken over by another process, or done
        source = batch.source_file_id
        if batch.status != VALIDATING:  # cancelled while validating
            release(session, batch_id, lease, source)
            session.commit()
            return
        total, invalid = _store_lines(session, batch, check, pieces(session, source), settings.max_request_bytes,
                                      SchemaBounds.of(settings))
        now = utcnow()
        moved = (dict(status=BatchStatus.failed.value, failed_at=now) if total == invalid
                 else dict(status=BatchStatus.in_progress.value, in_progress_at=now))
        # only from `validating`, in the transaction that holds the jobs: a cancel either came first (and nothing
        # runs) or waits for this commit and then finds the jobs to cancel
        opened = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == VALIDATING,
                                                     Batch.ingest_lease_id == lease)
                                 .values(total=total, invalid_lines=invalid, source_file_id=None,
                                         ingest_lease_expires_at=None, **moved))
        if opened.rowcount == 0:  # cancelled meanwhile (this lease ends it), or taken over (the new one does)
            session.rollback()
            release(session, batch_id, lease, source)
            session.commit()
            return
        _drop_upload(session, source)
        session.commit()
        publish_lines(celery, sessions, session, settings, batch_id, router)


def publish_lines(celery: Celery, sessions: sessionmaker[Session], session: Session, settings: Settings,
                  batch_id: uuid.UUID, router: Router | None) -> None:
    """Publish a committed batch's jobs as one read streamed a page at a time, so that the API's memory does not
    grow with the batch. A message (and its route) needs a few columns per job.

    The lines were stamped `published_at` as they were inserted, which saves a second write of every row (the
    stamp was most of an ingest's database time). A line whose message the broker refused has its stamp taken back
    (`publish`); one whose message never went out because this process died is a sent job whose message is
    missing: the sweep sends it once two sweeps in a row found no message for it, as it does for a message Redis
    lost."""
    lines = (select(Job.id, Job.kind, Job.priority, Job.tenant, Job.conversation_id, Job.batch_id)
             .where(Job.batch_id == batch_id).execution_options(yield_per=PUBLISH_PAGE))
    with sessions() as reader:
        for page in reader.execute(lines).partitions():
            publish(celery, session, page, settings, router=router, stamped=True)


def release(session: Session, batch_id: uuid.UUID, lease: uuid.UUID, source: str) -> None:
    """End the ingest of a batch that will not run (uncommitted): its lines are no longer needed."""
    released = session.execute(update(Batch).where(Batch.id == batch_id, Batch.ingest_lease_id == lease)
                               .values(source_file_id=None, ingest_lease_expires_at=None))
    if released.rowcount:
        _drop_upload(session, source)


def _drop_upload(session: Session, file_id: str) -> None:
    """A multipart upload's stored lines go once read (its chunks with it); a file uploaded to `/v1/files` stays."""
    session.execute(delete(File).where(File.id == file_id, File.purpose == UPLOAD_PURPOSE))


def failed(sessions: sessionmaker[Session], batch_id: uuid.UUID, lease: uuid.UUID, exc: Exception) -> None:
    """Count an ingest that raised; at the `MAX_FAILURES`th the batch fails (a line error says why), else its lease
    lapses and another try comes after it."""
    with sessions() as session:
        failures = session.scalar(update(Batch).where(Batch.id == batch_id, Batch.ingest_lease_id == lease)
                                  .values(ingest_failures=Batch.ingest_failures + 1)
                                  .returning(Batch.ingest_failures))
        if failures is not None and failures >= MAX_FAILURES:
            source = session.scalar(select(Batch.source_file_id).where(Batch.id == batch_id))
            session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == VALIDATING)
                            .values(status=BatchStatus.failed.value, failed_at=utcnow(), invalid_lines=1))
            insert_ignore(session, BatchLineError, {"batch_id": batch_id, "line": 0, "custom_id": None,
                                                    "message": f"ingest failed {failures} times: {reason(exc)}"})
            if source is not None:
                release(session, batch_id, lease, source)
        session.commit()


def reason(exc: Exception) -> str:
    """Why an ingest raised, for its batch's line error: the database's own first line for a database error (a
    statement timeout, a full disk), never the statement or its parameters, which SQLAlchemy's text quotes."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else None
    if cause is None:
        return type(exc).__name__
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"the database refused it ({type(exc).__name__}: {first})"[:MAX_MESSAGE]


def _store_lines(session: Session, batch: Batch, check: PromptCheck, source: Iterable[bytes],
                 max_line_bytes: int, bounds: SchemaBounds) -> tuple[int, int]:
    """Insert a job per good line and a `BatchLineError` per bad one (uncommitted); (lines, bad lines)."""
    jobs: list[dict] = []
    bad: list[dict] = []
    total = invalid = 0
    now = utcnow()

    def flush() -> None:
        if jobs:
            # stamped published as they are inserted (see `publish_lines`): one write per line, not two
            copy_ignore(session, Job, jobs, published_at=db_now())
        if bad:
            insert_ignore(session, BatchLineError, bad)
        jobs.clear()
        bad.clear()

    for item in parse_lines(source, batch.priority, max_line_bytes, bounds):
        total += 1
        if isinstance(item, ParsedLine) and (problem := _problem(check, item)):
            item = LineError(item.line, item.custom_id, f"{problem[0]}: {problem[1]}")
        if isinstance(item, ParsedLine):
            jobs.append(job_row(item.job, now, deadline_at=batch.expires_at, batch_id=batch.id,
                                custom_id=item.custom_id, owner=batch.owner, tenant=batch.tenant))
        else:
            invalid += 1
            # PostgreSQL text holds no NUL, and a reason may quote what the line held
            bad.append({"batch_id": batch.id, "line": item.line, "custom_id": item.custom_id,
                        "message": item.message.replace("\x00", "\ufffd")[:MAX_MESSAGE]})
        if len(jobs) + len(bad) >= INSERT_ROWS:
            flush()
    flush()
    return total, invalid


def _problem(check: PromptCheck, item: ParsedLine) -> tuple[str, str] | None:
    """Why the line's job can never run on the model, or None; a check that raises is the line's error too."""
    try:
        return check.problem(item.job)
    except Exception as exc:
        log.exception("line %d: the prompt check failed", item.line)
        return "messages", f"could not be checked against the model ({type(exc).__name__})"
