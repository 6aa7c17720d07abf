"""Putting committed jobs on the broker: the API for new jobs, the worker and reconciler for retries."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from celery import Celery
from kombu import Producer
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from broker.affinity import Router, Waiting, by_name
from broker.redis_layout import broker_priority
from broker.view import GROUP_HEADER
from jobs.queues import TASK_RUN_GROUP, TASK_RUN_JOB, home_queue, queue_for
from jobs.settings import Settings
from jobs.status import JobStatus
from jobs.tables import Job
from store.clock import db_now

log = logging.getLogger(__name__)


def publish(
    celery: Celery, session: Session, jobs: Sequence[Job], settings: Settings, countdown: float = 0,
    stamped: bool = False, router: Router | None = None,
) -> list[uuid.UUID]:
    """Send the jobs' messages over one connection, then stamp `published_at` on those that went out, in this
    session. `stamped`: the rows were stamped as they were inserted (`published_at=db_now()`: one write per
    job, not two), so only those whose message did not go out are written, their stamps taken back. With a
    `router`, a job with a conversation goes to its home worker's queue while that queue has room
    (`broker.affinity`). A job is anything with a job's `id`, `kind` and `priority` (a `Job`, or a row of those
    columns); one with a `batch_id` is a batch line.

    An interactive job, or one sent to its home worker, has a message of its own (`convoq.run_job`); bulk lines
    of one batch go `settings.bulk_group` to a message (`convoq.run_group`, its jobs listed in the
    `GROUP_HEADER`), which a worker claims, stores and acknowledges together.

    A job whose message could not be sent stays `queued` with no `published_at`: the row keeps it, and the
    reconciler publishes it later. A stamp that fails is only logged: a sweep finds the message and stamps
    it (it never sends a second one); a stamp that could not be taken back leaves a job the sweep sees without
    a message, and sends once two sweeps in a row found none. Returns the ids of the jobs that went out.
    """
    sent = []
    homes = router.homes(session, jobs) if router is not None else {}
    try:
        with celery.producer_or_acquire() as producer:
            waiting = Waiting(producer.channel, settings.affinity_max_waiting)
            groups: dict[tuple, list] = {}
            for job in jobs:
                queue = queue_for(job.priority, settings)
                if (home := homes.get(job.id)) is not None and waiting.room(own := home_queue(queue, home)):
                    queue = by_name(own)
                elif (batch_id := getattr(job, "batch_id", None)) is not None and queue == settings.bulk_queue:
                    groups.setdefault((batch_id, job.priority, job.kind), []).append(job)
                    continue
                _send(celery, producer, [job], queue, countdown)
                sent.append(job.id)
            for members in groups.values():
                for start in range(0, len(members), settings.bulk_group):
                    group = members[start:start + settings.bulk_group]
                    _send(celery, producer, group, settings.bulk_queue, countdown)
                    sent += [job.id for job in group]
    except Exception:  # the broker is down or refused: the committed rows keep the jobs
        log.exception("published %d of %d jobs; the rest stay queued for the reconciler", len(sent), len(jobs))
    went = set(sent)
    write, ids = (unstamp, [job.id for job in jobs if job.id not in went]) if stamped else (mark_published, sent)
    if ids:
        try:
            write(session, ids)
        except DBAPIError:  # a deadlock with a claim or a cancel of the same rows, or the database away
            session.rollback()
            log.warning("%s of %d jobs failed; the reconciler's sweep puts them right", write.__name__, len(ids),
                        exc_info=True)
    return sent


def _send(celery: Celery, producer: Producer, jobs: Sequence[Job], queue: str, countdown: float) -> None:
    """One message for `jobs` (of one kind and priority): a job's own, or a group's under an id of its own."""
    first = jobs[0]
    ids = [str(job.id) for job in jobs]
    grouped = len(jobs) > 1
    labels = {"kind": first.kind, "priority": first.priority}  # for Flower: a chat told from a bulk summary
    celery.send_task(
        TASK_RUN_GROUP if grouped else TASK_RUN_JOB,
        args=[ids] if grouped else ids,
        kwargs=labels,
        # what Flower shows of the arguments, written here: Celery's own careful repr of them costs more than the
        # rest of the message (a group's ids are summed up, not listed)
        argsrepr=f"[{len(ids)} jobs: {ids[0]}, ...]" if grouped else repr(ids),
        kwargsrepr=repr(labels),
        task_id=str(uuid.uuid4()) if grouped else ids[0],
        headers={GROUP_HEADER: ids} if grouped else None,
        queue=queue,
        priority=broker_priority(first.priority),
        producer=producer,
        countdown=countdown or None,
        ignore_result=True,  # results go to PostgreSQL: no result backend to tell of the task
        retry=True,
        retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2},
    )


def mark_published(session: Session, job_ids: list[uuid.UUID]) -> None:
    """Stamp the jobs whose messages went out. A row another transaction holds (a claim or a cancel of it) is
    skipped, not waited for: that transaction moves the job on (the stamp matters only while it is queued), and
    if it rolls back, a sweep finds the message and stamps it. So a stamp never waits, nor deadlocks."""
    jobs_table = Job.__table__  # Core: nothing reads `published_at` back from the callers' objects
    free = select(jobs_table.c.id).where(jobs_table.c.id.in_(job_ids)).with_for_update(skip_locked=True)
    session.execute(update(jobs_table).where(jobs_table.c.id.in_(free))
                    .values(published_at=db_now(), message_missing_at=None))  # compared on the database's clock
    session.commit()


def unstamp(session: Session, job_ids: list[uuid.UUID]) -> None:
    """Take back the stamps of jobs stamped at insert whose messages did not go out: the reconciler sends them
    once `unpublished_grace_s` has passed, as any job never published."""
    jobs_table = Job.__table__
    queued = jobs_table.c.status == JobStatus.queued.value
    session.execute(update(jobs_table).where(jobs_table.c.id.in_(job_ids), queued).values(published_at=None))
    session.commit()
