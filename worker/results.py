"""The worker's writes: claiming a job, then storing its result and timings exactly once.

Delivery is at-least-once, so every write here is safe to repeat: the claim only moves non-terminal jobs,
result and timings rows are keyed by the job id and inserted with ON CONFLICT DO NOTHING, and the final
status update only touches a job that is not yet terminal. Writes retry with backoff while the database
is unreachable; the Celery message is acknowledged only after `store` returns.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from pydantic import ValidationError
from sqlalchemy import ColumnElement, bindparam, case, or_, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from engine.interface import Completion
from jobs.batches import settle_batch
from jobs.db import insert_ignore
from jobs.schemas import JobIn, JobStatus
from jobs.tables import Job, Result, Timing, as_utc, utcnow
from worker.outcome import STOPPED, Outcome

log = logging.getLogger(__name__)
T = TypeVar("T")
NOT_TERMINAL = (JobStatus.queued.value, JobStatus.running.value)


@dataclass
class Claimed:
    job_id: uuid.UUID
    job: JobIn  # the payload, validated once at claim
    created_at: datetime
    batch_id: uuid.UUID | None
    attempt: int
    deadline_at: datetime | None = None


def ms_between(a: datetime, b: datetime) -> float:
    return (as_utc(b) - as_utc(a)).total_seconds() * 1e3


def retrying(action: Callable[[], T], what: str, deadline_s: float = 600.0) -> T:
    """Run a database action, retrying with capped exponential backoff while the database is away."""
    delay, start = 0.2, time.monotonic()
    while True:
        try:
            return action()
        except (OperationalError, DBAPIError) as exc:
            if time.monotonic() - start > deadline_s or not _transient(exc):
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1fs", what, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _transient(exc: DBAPIError) -> bool:
    return isinstance(exc, OperationalError) or exc.connection_invalidated


def storable(text: str) -> str:
    """PostgreSQL text cannot hold NUL, which a byte-level tokenizer can produce: store U+FFFD instead."""
    return text.replace("\x00", "\ufffd")


def fail(sessions: sessionmaker[Session], claimed: Claimed, error: str) -> None:
    """A job whose run raised: it ends `failed` with the error instead of staying `running` forever."""
    _fail(sessions, claimed.job_id, claimed.batch_id, error)


def _fail(sessions: sessionmaker[Session], job_id: uuid.UUID, batch_id: uuid.UUID | None, error: str) -> None:
    def action() -> None:
        with sessions.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.in_(NOT_TERMINAL))
                .values(status=JobStatus.failed.value, error=storable(error)[:4000], finished_at=utcnow())
            )

    retrying(action, f"fail {job_id}")
    if batch_id is not None:
        retrying(lambda: settle(sessions, batch_id), f"settle batch {batch_id}")


NOT_RUN_ERRORS = {JobStatus.cancelled.value: "cancelled before it ran",
                  JobStatus.expired.value: "its deadline passed before it ran"}
STOPPED_ERRORS = {"cancelled": "cancelled while it ran; the text it had is kept in its result",
                  "expired": "its deadline passed while it ran; the text it had is kept in its result"}


def end_unrun(session: Session, now: datetime, *where: ColumnElement[bool]) -> list[tuple[uuid.UUID, uuid.UUID | None]]:
    """End the queued jobs (among `where`) that must not run: a cancel was asked for (`cancelled`), or their
    deadline has passed (`expired`). Returns (job id, batch id) of each."""
    jobs = Job.__table__
    cancelled = jobs.c.cancel_requested_at.is_not(None)
    status = case((cancelled, JobStatus.cancelled.value), else_=JobStatus.expired.value)
    error = case((cancelled, NOT_RUN_ERRORS[JobStatus.cancelled.value]), else_=NOT_RUN_ERRORS[JobStatus.expired.value])
    return [tuple(row) for row in session.execute(
        update(jobs)
        .where(*where, jobs.c.status == JobStatus.queued.value, or_(cancelled, jobs.c.deadline_at <= now))
        .values(status=status, error=error, finished_at=now)
        .returning(jobs.c.id, jobs.c.batch_id)
    )]


def claim(sessions: sessionmaker[Session], job_id: str, worker: str, max_attempts: int) -> Claimed | None:
    """Mark a queued job running; None if it is not queued (a duplicate message, or already taken)."""
    return claim_many(sessions, [job_id], worker, max_attempts)[0]


def claim_many(sessions: sessionmaker[Session], job_ids: list[str], worker: str,
               max_attempts: int) -> list[Claimed | None]:
    """`claim` for many jobs in one statement; an id listed twice is claimed once, by its first entry.

    A job that has used up its attempts (it crashed or failed that often), or whose payload is not a valid job,
    is failed here instead of run; one cancelled or past its deadline ends without running (`end_unrun`).
    """
    jobs = Job.__table__
    ids = {uuid.UUID(i) for i in job_ids}

    def action() -> tuple[dict[uuid.UUID, tuple], set[uuid.UUID]]:
        now = utcnow()
        with sessions.begin() as session:
            rows = session.execute(
                update(jobs)
                .where(jobs.c.id.in_(ids), jobs.c.status == JobStatus.queued.value,
                       jobs.c.cancel_requested_at.is_(None), or_(jobs.c.deadline_at.is_(None), jobs.c.deadline_at > now))
                .values(status=JobStatus.running.value, attempts=jobs.c.attempts + 1, worker=worker, started_at=now)
                .returning(jobs.c.id, jobs.c.payload, jobs.c.created_at, jobs.c.batch_id, jobs.c.attempts,
                           jobs.c.error, jobs.c.deadline_at)
            ).all()
            # the rest are duplicates, or must not run; only then is a second statement needed
            rest = ids - {row.id for row in rows}
            ended = end_unrun(session, now, jobs.c.id.in_(rest)) if rest else []
        return {row.id: row for row in rows}, {batch_id for _, batch_id in ended if batch_id is not None}

    rows, batches = retrying(action, f"claim {len(job_ids)} jobs")
    for batch_id in batches:
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    out: list[Claimed | None] = []
    for job_id in job_ids:
        row = rows.pop(uuid.UUID(job_id), None)
        if row is None:
            out.append(None)
            continue
        if row.attempts > max_attempts:
            _fail(sessions, row.id, row.batch_id,
                  f"gave up after {max_attempts} attempts; last error: {row.error or 'the worker died'}")
            out.append(None)
            continue
        try:
            job = JobIn.model_validate(row.payload)
        except ValidationError as exc:
            _fail(sessions, row.id, row.batch_id, f"the job's payload is not a valid job: {exc}")
            out.append(None)
            continue
        out.append(Claimed(row.id, job, row.created_at, row.batch_id, row.attempts, row.deadline_at))
    return out


def requeue(sessions: sessionmaker[Session], claimed: Claimed, error: str) -> bool:
    """Put a job that failed this attempt back to `queued` (for a delayed retry); False if it moved on."""

    def action() -> bool:
        with sessions.begin() as session:
            return session.execute(
                update(Job).where(Job.id == claimed.job_id, Job.status == JobStatus.running.value)
                .values(status=JobStatus.queued.value, worker=None, published_at=None, error=storable(error)[:4000])
            ).rowcount == 1

    return retrying(action, f"requeue {claimed.job_id}")


@dataclass
class Stored:
    """What `store` wrote: the job's final status and, for a successful job, its timings row."""

    status: JobStatus
    timing: dict | None


def finished_status(completion: Completion) -> JobStatus:
    if completion.finish_reason in STOPPED:
        return JobStatus(completion.finish_reason)
    return JobStatus.succeeded if completion.ok else JobStatus.failed


def timing_row(claimed: Claimed, outcome: Outcome, batch_prefix: str, now: datetime) -> dict:
    """The job's timings: queue wait and time to first token count from the job's creation (the engine's clock
    starts there: `Bridge.submit`)."""
    c, t = outcome.completion, outcome.completion.timings
    busy_s = (t.prefill_ms + t.decode_ms) / 1e3
    return dict(
        job_id=claimed.job_id,
        queue_wait_ms=t.queue_wait_ms,
        ttft_ms=t.ttft_ms,
        prefill_ms=t.prefill_ms,
        decode_ms=t.decode_ms,
        engine_ms=outcome.engine_ms,
        end_to_end_ms=ms_between(claimed.created_at, now),
        tokens_per_s=len(c.token_ids) / busy_s if busy_s > 0 else 0.0,
        batch_id=f"{batch_prefix}:{t.batch_id}" if t.batch_id >= 0 else None,
        batch_size=t.batch_size,
        prompt_tokens_reused=t.prompt_tokens_reused,
        host_tokens_reused=t.host_tokens_reused,
        created_at=now,
    )


def store(sessions: sessionmaker[Session], claimed: Claimed, outcome: Outcome, batch_prefix: str) -> Stored:
    return store_many(sessions, [(claimed, outcome)], batch_prefix)[0]


def store_many(sessions: sessionmaker[Session], done: list[tuple[Claimed, Outcome]], batch_prefix: str) -> list[Stored]:
    """Results, timings and final statuses of finished jobs in one transaction; then their batches settle."""
    jobs = Job.__table__
    finish = (
        update(jobs)
        # spelled out, not IN: an IN list cannot be part of a statement run for many rows
        .where(jobs.c.id == bindparam("job"), or_(*(jobs.c.status == s for s in NOT_TERMINAL)))
        .values(status=bindparam("new_status"), error=bindparam("new_error"), finished_at=bindparam("now"))
    )

    def action() -> list[Stored]:
        now = utcnow()
        stored, result_rows, timing_rows, finished = [], [], [], []
        for claimed, outcome in done:
            c = outcome.completion
            timing = timing_row(claimed, outcome, batch_prefix, now) if c.ok else None
            if timing is not None:
                timing_rows.append(timing)
            if c.ok or c.finish_reason in STOPPED:  # a stopped job keeps the text it had
                result_rows.append(dict(
                    job_id=claimed.job_id, text=storable(c.text),
                    reasoning=None if outcome.reasoning is None else storable(outcome.reasoning),
                    prompt_tokens=c.prompt_tokens,
                    completion_tokens=len(c.token_ids), finish_reason=c.finish_reason, created_at=now,
                    chunks=outcome.chunks, levels=outcome.levels,
                ))
            status = finished_status(c)
            error = c.error or STOPPED_ERRORS.get(c.finish_reason)
            finished.append(dict(job=claimed.job_id, new_status=status.value,
                                 new_error=error and storable(error), now=now))
            stored.append(Stored(status, timing))
        with sessions.begin() as session:
            if result_rows:
                insert_ignore(session, Result, result_rows)
            if timing_rows:
                insert_ignore(session, Timing, timing_rows)
            session.connection().execute(finish, finished)
        return stored

    stored = retrying(action, f"store {len(done)} jobs")
    for batch_id in dict.fromkeys(claimed.batch_id for claimed, _ in done if claimed.batch_id is not None):
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    return stored


def settle(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> None:
    with sessions.begin() as session:
        settle_batch(session, batch_id)


