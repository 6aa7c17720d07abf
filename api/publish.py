"""Putting a committed job on the broker."""

from __future__ import annotations

import logging

from celery import Celery
from sqlalchemy import update
from sqlalchemy.orm import Session

from jobs.queues import broker_priority, queue_for
from jobs.settings import Settings
from jobs.tables import Job, utcnow
from worker.celery_app import TASK_RUN_JOB

log = logging.getLogger(__name__)


def publish(celery: Celery, session: Session, job: Job, settings: Settings) -> bool:
    """Send the job's message; on failure the row stays `queued` with no `published_at`, for the reconciler."""
    try:
        celery.send_task(
            TASK_RUN_JOB,
            args=[str(job.id)],
            task_id=str(job.id),
            queue=queue_for(job.kind, settings),
            priority=broker_priority(job.priority),
            retry=True,
            retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
        )
    except Exception:  # the broker is down or refused: the committed row keeps the job
        log.exception("could not publish job %s; it stays queued for the reconciler", job.id)
        return False
    session.execute(update(Job).where(Job.id == job.id).values(published_at=utcnow()))
    session.commit()
    return True
