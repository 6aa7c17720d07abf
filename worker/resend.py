"""The sweep's repair of lost messages. A queued job is sent again only on evidence that no message for it
exists (`broker.view.BrokerView`), and a published job's message must be missing at two sweeps in a row. What
waits in the own queues of workers that no longer read them moves to the shared queues."""

from __future__ import annotations

import logging
import uuid

import redis
from celery import Celery
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Router, homes_open, shared_queues
from broker.publish import mark_published, publish
from broker.view import BrokerView
from jobs.queues import home_tag
from jobs.settings import Settings
from jobs.tables import Job
from store.clock import db_now
from worker.chunks import CHUNK, Hold, chunks, keep_hold
from worker.fence import QUEUED

log = logging.getLogger(__name__)


def resend(sessions: sessionmaker[Session], celery: Celery, settings: Settings, broker: BrokerView,
           router: Router, hold: Hold = None) -> tuple[list[uuid.UUID], int]:
    """Send again the queued jobs with no live message (see the module's doc), in chunks (`hold` before each);
    returns the ids sent and how many published jobs were seen without a message for the first time
    (`message_missing_at`: the next sweep, by whichever worker, sends those still missing)."""
    jobs = Job.__table__
    live = broker.live(settings.dead_after_s)  # read before the rows, since a message consumed since is a running job
    grace = db_now(-settings.unpublished_grace_s)
    # Never sent, for longer than the grace. A job put back to `queued` by a writer that sends its message itself
    # (a retry's, a stall's, a shutdown's) is stamped as published then (`run_ends.sent_now_columns`). So it is
    # judged from that moment, and its backoff holds. One the sweep must send (its lease expired) goes at once.
    never = jobs.c.published_at.is_(None) & (jobs.c.created_at < grace)
    if live is None:  # with no view into the broker, only the age of the last publish says a message was lost
        sent_long_ago = jobs.c.published_at < db_now(-settings.republish_after_s)
        with sessions() as session:
            due = list(session.scalars(select(jobs.c.id).where(jobs.c.status == QUEUED, or_(never, sent_long_ago))))
        return _send(sessions, celery, settings, broker, router, due, hold), 0
    found, reappeared, missing, due = [], [], [], []
    page = select(jobs.c.id, jobs.c.published_at, jobs.c.message_missing_at).where(
        jobs.c.status == QUEUED, or_(never, jobs.c.published_at < grace)).order_by(jobs.c.id).limit(CHUNK)
    after = None
    while True:  # a page per short read, not one read as long as the backlog
        keep_hold(hold)
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
    for chunk in chunks(found):  # stamping clears `message_missing_at` too
        keep_hold(hold)
        with sessions() as session:
            mark_published(session, chunk)
    for ids, value in ((reappeared, None), (missing, db_now())):
        for chunk in chunks(ids):
            keep_hold(hold)
            with sessions.begin() as session:
                session.execute(update(jobs).where(jobs.c.id.in_(chunk), jobs.c.status == QUEUED)
                                .values(message_missing_at=value))
    return _send(sessions, celery, settings, broker, router, due, hold), len(missing)


def _send(sessions: sessionmaker[Session], celery: Celery, settings: Settings, broker: BrokerView, router: Router,
          job_ids: list[uuid.UUID], hold: Hold) -> list[uuid.UUID]:
    sent: list[uuid.UUID] = []
    for chunk in chunks(job_ids):
        keep_hold(hold)
        with sessions() as session:
            stranded = list(session.scalars(select(Job).where(Job.id.in_(chunk), Job.status == QUEUED)))
            sent += publish(celery, session, stranded, settings, router=router) if stranded else []
    broker.forget(sent)
    if job_ids:
        log.warning("reconciler: %d of %d queued jobs with no message sent again", len(sent), len(job_ids))
    return sent


def rehome_gone(sessions: sessionmaker[Session], broker: BrokerView, dead_after_s: float) -> int:
    """Move to the shared queues what the own queues that no worker reads still hold. Those are the queues of
    workers not alive, draining, or not consuming that class (`broker.affinity.homes_open`). With the broker away
    nothing moves now, and nothing else of the sweep stops. The next sweep moves them."""
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
