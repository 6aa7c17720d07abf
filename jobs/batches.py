"""Batch state that both sides move: the worker settles a batch when its last job ends; the API on reads."""

from __future__ import annotations

import uuid

from sqlalchemy import exists, update
from sqlalchemy.orm import Session

from jobs.schemas import BatchStatus, JobStatus
from jobs.tables import Batch, Job, utcnow

PENDING = (JobStatus.queued.value, JobStatus.running.value)


def settle_batch(session: Session, batch_id: uuid.UUID) -> None:
    """Move an in-progress batch to completed, or a cancelling one to cancelled, once no job is pending.

    Run it in its own transaction *after* a job's final write committed: two workers finishing a batch's
    last two jobs at once would each still see the other's job running inside their own transaction.
    """
    pending = exists().where(Job.batch_id == batch_id, Job.status.in_(PENDING))
    now = utcnow()
    moves = [
        (BatchStatus.in_progress, dict(status=BatchStatus.finalizing.value, finalizing_at=now)),
        (BatchStatus.finalizing, dict(status=BatchStatus.completed.value, completed_at=now)),
        (BatchStatus.cancelling, dict(status=BatchStatus.cancelled.value, cancelled_at=now)),
    ]
    for current, values in moves:
        session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == current.value, ~pending).values(**values)
        )
