"""Putting committed jobs on the broker: the API for new jobs, the worker and reconciler for retries."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence

from celery import Celery
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from jobs.affinity import Router, Waiting, direct_queue
from jobs.clock import db_now
from jobs.group_commit import GroupCommit
from jobs.queues import TASK_RUN_JOB, broker_priority, home_queue, queue_for
from jobs.settings import Settings
from jobs.tables import Job

log = logging.getLogger(__name__)


def publish(
    celery: Celery, session: Session, jobs: Sequence[Job], settings: Settings, countdown: float = 0,
    stamp: Callable[[list[uuid.UUID]], object] | None = None, router: Router | None = None,
) -> list[uuid.UUID]:
    """Send one message per job over one connection, then stamp `published_at` on those that went out: in
    this session, or by handing their ids to `stamp` (a `stamp_writer`'s `submit`). With a `router`, a job
    with a conversation goes to its home worker's queue while that queue has room (`jobs.affinity`).

    A job whose message could not be sent stays `queued` with no `published_at`: the row keeps it, and the
    reconciler publishes it later. A stamp that fails is only logged: a sweep finds the message and stamps
    it (it never sends a second one). Returns the ids of the jobs that went out.
    """
    sent = []
    homes = router.homes(session, jobs) if router is not None else {}
    try:
        with celery.producer_or_acquire() as producer:
            waiting = Waiting(producer.channel, settings.affinity_max_waiting)
            for job in jobs:
                queue = queue_for(job.priority, settings)
                if (home := homes.get(job.id)) is not None and waiting.room(own := home_queue(queue, home)):
                    queue = direct_queue(own)
                celery.send_task(
                    TASK_RUN_JOB,
                    args=[str(job.id)],
                    kwargs={"kind": job.kind, "priority": job.priority},  # labels for Flower
                    task_id=str(job.id),
                    queue=queue,
                    priority=broker_priority(job.priority),
                    producer=producer,
                    countdown=countdown or None,
                    retry=True,
                    retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
                )
                sent.append(job.id)
    except Exception:  # the broker is down or refused: the committed rows keep the jobs
        log.exception("published %d of %d jobs; the rest stay queued for the reconciler", len(sent), len(jobs))
    if sent and stamp is not None:
        stamp(sent)
    elif sent:
        try:
            mark_published(session, sent)
        except DBAPIError:  # a deadlock with a claim or a cancel of the same rows, or the database away
            session.rollback()
            log.warning("sent %d jobs but could not stamp them; a sweep finds their messages and stamps them",
                        len(sent), exc_info=True)
    return sent


def mark_published(session: Session, job_ids: list[uuid.UUID]) -> None:
    """Stamp the jobs whose messages went out. A row another transaction holds (a claim or a cancel of it) is
    skipped, not waited for: that transaction moves the job on (the stamp matters only while it is queued), and
    if it rolls back, a sweep finds the message and stamps it. So a stamp never waits, nor deadlocks."""
    jobs_table = Job.__table__  # Core: nothing reads `published_at` back from the callers' objects
    free = select(jobs_table.c.id).where(jobs_table.c.id.in_(job_ids)).with_for_update(skip_locked=True)
    session.execute(update(jobs_table).where(jobs_table.c.id.in_(free))
                    .values(published_at=db_now(), message_missing_at=None))  # compared on the database's clock
    session.commit()


def stamp_writer(sessions: sessionmaker[Session]) -> GroupCommit[list[uuid.UUID], None]:
    """Stamps `published_at` in the background, for everything published meanwhile in one statement.

    The API's jobs take this path, so a submission costs one transaction, not two. A stamp that never lands
    (the process died first, or the database is away) only makes the reconciler publish that job again once
    `unpublished_grace_s` has passed, and the duplicate message is dropped at claim.
    """

    def flush(batches: list[list[uuid.UUID]]) -> list[None]:
        try:
            with sessions() as session:
                mark_published(session, [job_id for ids in batches for job_id in ids])
        except Exception:
            log.exception("could not stamp %d published jobs; the reconciler will publish them again",
                          sum(map(len, batches)))
        return [None] * len(batches)

    return GroupCommit(flush, "published-stamps")
