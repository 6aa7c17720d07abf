"""Putting committed jobs on the broker: the API for new jobs, the worker and reconciler for retries."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from celery import Celery
from sqlalchemy import update
from sqlalchemy.orm import Session

from jobs.queues import TASK_RUN_JOB, broker_priority, queue_for
from jobs.settings import Settings
from jobs.tables import Job, utcnow

log = logging.getLogger(__name__)


def publish(
    celery: Celery, session: Session, jobs: Sequence[Job], settings: Settings, countdown: float = 0
) -> list[uuid.UUID]:
    """Send one message per job over one connection, then stamp `published_at` on those that went out.

    A job whose message could not be sent stays `queued` with no `published_at`: the row keeps it, and the
    reconciler publishes it later. Returns the ids of the jobs that went out.
    """
    sent = []
    try:
        with celery.producer_or_acquire() as producer:
            for job in jobs:
                celery.send_task(
                    TASK_RUN_JOB,
                    args=[str(job.id)],
                    task_id=str(job.id),
                    queue=queue_for(job.kind, settings),
                    priority=broker_priority(job.priority),
                    producer=producer,
                    countdown=countdown or None,
                    retry=True,
                    retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
                )
                sent.append(job.id)
    except Exception:  # the broker is down or refused: the committed rows keep the jobs
        log.exception("published %d of %d jobs; the rest stay queued for the reconciler", len(sent), len(jobs))
    if sent:
        jobs_table = Job.__table__  # Core: nothing reads `published_at` back from these objects
        session.execute(update(jobs_table).where(jobs_table.c.id.in_(sent)).values(published_at=utcnow()))
        session.commit()
    return sent
