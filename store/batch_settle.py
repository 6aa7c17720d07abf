"""Batch state that both sides move: the worker settles a batch when its last job ends; the API on reads."""

from __future__ import annotations

import uuid

from sqlalchemy import Connection, bindparam, exists, select, true, update
from sqlalchemy.orm import Session

from jobs.status import BatchStatus, JobStatus
from jobs.tables import Batch, Job, utcnow
from store.clock import db_now

PENDING = (JobStatus.queued.value, JobStatus.running.value)
# Whether a batch still has a job queued or running: built once, as most settles end with it (building and keying
# a statement costs more CPU than the database spends on it, and a worker asks at every store of a batch's lines)
_ANY_PENDING = select(exists().where(Job.batch_id == bindparam("batch"), Job.status.in_(PENDING)))


def batch_pending(conn: Connection | Session, batch_id: uuid.UUID) -> bool:
    """Whether a job of the batch is still queued or running."""
    return conn.scalar(_ANY_PENDING, {"batch": batch_id})


def settle_batch(session: Session, batch_id: uuid.UUID) -> None:
    """Move an in-progress batch to completed (or expired), or a cancelling one to cancelled, once no job is
    pending.

    Run it in its own transaction *after* a job's final write committed: two workers finishing a batch's
    last two jobs at once would each still see the other's job running inside their own transaction.
    """
    if batch_pending(session, batch_id):  # most calls, while the batch runs: one statement instead of four
        return
    pending = exists().where(Job.batch_id == batch_id, Job.status.in_(PENDING))
    now = utcnow()
    # its window closed on unfinished items: the batch itself ends `expired`, as OpenAI's do
    window_closed = (Batch.expires_at <= db_now()) & exists().where(Job.batch_id == batch_id,
                                                               Job.status == JobStatus.expired.value)
    moves = [
        (BatchStatus.in_progress, window_closed, dict(status=BatchStatus.expired.value, expired_at=now)),
        (BatchStatus.in_progress, true(), dict(status=BatchStatus.finalizing.value, finalizing_at=now)),
        (BatchStatus.finalizing, true(), dict(status=BatchStatus.completed.value, completed_at=now)),
        (BatchStatus.cancelling, true(), dict(status=BatchStatus.cancelled.value, cancelled_at=now)),
    ]
    for current, condition, values in moves:
        session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == current.value, ~pending, condition)
            .values(**values)
        )
