"""Nothing lost: heartbeats, and the sweep that puts stranded jobs back on the queue.

Every worker process beats into the `workers` table and, on the same thread, runs `reconcile()`:
- `running` jobs of a worker whose heartbeat stopped (killed, host lost) go back to `queued`;
- `queued` jobs with no message out (the publish failed, or a worker handed them back) are published;
- `queued` jobs whose message a consumer took and holds unacknowledged for longer than a live worker ever
  would before claiming (a worker killed between fetching and claiming) are published again, and after a
  worker death so are queued jobs whose message is nowhere in the broker (lost as it was being fetched);
- `queued` jobs published long ago and still queued (a message lost with the broker) are published again;
- `queued` jobs past their deadline end `expired` (and their batches settle) without waiting for a claim.
It also finds the jobs this worker runs whose cancel was asked for (the broadcast that normally stops them
at once may have been missed) and stops them.
Duplicate messages are harmless: a job is claimed only while `queued`, so the extra one is dropped.
Every step is a conditional UPDATE, so any number of workers may sweep at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import redis
from celery import Celery
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from jobs.broker import UNACKED_INDEX_KEY, UNACKED_KEY, queue_lists
from jobs.db import insert_ignore
from jobs.publish import publish
from jobs.schemas import JobStatus
from jobs.settings import Settings
from jobs.tables import Job, Worker, utcnow
from worker.results import end_unrun, retrying, settle

log = logging.getLogger(__name__)


def beat(sessions: sessionmaker[Session], name: str) -> None:
    now = utcnow()
    with sessions.begin() as session:
        insert_ignore(session, Worker, dict(name=name, hostname=socket.gethostname(), pid=os.getpid(),
                                             started_at=now, heartbeat_at=now))
        # a worker cut off longer than dead_after_s was declared dead; beating again makes it alive again
        session.execute(update(Worker).where(Worker.name == name).values(heartbeat_at=now, stopped_at=None))


def hand_back(sessions: sessionmaker[Session], name: str) -> int:
    """A worker stopping cleanly returns the jobs it still holds; they are published again by a sweep."""
    with sessions.begin() as session:
        n = session.execute(
            update(Job).where(Job.worker == name, Job.status == JobStatus.running.value)
            .values(status=JobStatus.queued.value, worker=None, published_at=None)
        ).rowcount
        session.execute(update(Worker).where(Worker.name == name).values(stopped_at=utcnow()))
    return n


def _job_id(raw: bytes, unacked: bool) -> uuid.UUID | None:
    try:
        message = json.loads(raw)
        return uuid.UUID((message[0] if unacked else message)["headers"]["id"])
    except (TypeError, ValueError, KeyError, IndexError):
        return None  # not one of our task messages


class BrokerView:
    """What Kombu's Redis transport holds for our jobs (task id = job id).

    Each delivered, unacknowledged message sits in the `unacked` hash, indexed by delivery time in
    `unacked_index`; waiting messages sit in the queues' priority lists. Once a job is published again, its
    stale `unacked` entry is dropped so that neither a later sweep nor kombu's own restore sends it again.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        redis_url = settings.broker_url.get_secret_value().startswith(("redis://", "rediss://"))
        self.client = redis.Redis.from_url(settings.broker_url.get_secret_value()) if redis_url else None
        self.tags: dict[uuid.UUID, bytes] = {}

    def held_unclaimed(self, older_than_s: float) -> list[uuid.UUID]:
        """Jobs whose message a consumer fetched over `older_than_s` ago and has not acknowledged."""
        if self.client is None:
            return []
        tags = self.client.zrangebyscore(UNACKED_INDEX_KEY, 0, time.time() - older_than_s)
        for tag, raw in zip(tags, self.client.hmget(UNACKED_KEY, tags) if tags else [], strict=True):
            if raw and (job_id := _job_id(raw, unacked=True)):
                self.tags[job_id] = tag
        return list(self.tags)

    def present(self) -> set[uuid.UUID] | None:
        """Every job with a message anywhere in the broker; None if the broker cannot be read this way."""
        if self.client is None:
            return None
        lists = [name for names in queue_lists(self.settings).values() for name in names]
        raws = [raw for name in lists for raw in self.client.lrange(name, 0, -1)]
        ids = {_job_id(raw, unacked=False) for raw in raws}
        ids |= {_job_id(raw, unacked=True) for raw in self.client.hvals(UNACKED_KEY)}
        return ids - {None}

    def forget(self, job_ids: list[uuid.UUID]) -> None:
        tags = [self.tags[i] for i in job_ids if i in self.tags]
        if self.client is not None and tags:
            self.client.pipeline().zrem(UNACKED_INDEX_KEY, *tags).hdel(UNACKED_KEY, *tags).execute()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def reconcile(sessions: sessionmaker[Session], celery: Celery, settings: Settings) -> dict[str, int]:
    now = utcnow()
    broker = BrokerView(settings)
    with sessions.begin() as session:
        dead = list(session.scalars(select(Worker.name).where(
            Worker.heartbeat_at < now - timedelta(seconds=settings.dead_after_s), Worker.stopped_at.is_(None)
        )))
        orphans = session.execute(
            update(Job).where(Job.status == JobStatus.running.value, Job.worker.in_(dead))
            .values(status=JobStatus.queued.value, worker=None, published_at=None)
        ).rowcount
        session.execute(update(Worker).where(Worker.name.in_(dead)).values(stopped_at=now))
    with sessions.begin() as session:
        expired = end_unrun(session, now, Job.deadline_at <= now)
    for batch_id in {b for _, b in expired if b is not None}:
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    grace = now - timedelta(seconds=settings.unpublished_grace_s)
    lost = [
        Job.published_at.is_(None) & (Job.created_at < grace),
        Job.published_at < now - timedelta(seconds=settings.republish_after_s),
        Job.id.in_(broker.held_unclaimed(settings.dead_after_s)),
    ]
    with sessions() as session:
        if dead and (present := broker.present()) is not None:
            # a killed consumer can lose a message it had popped but not yet recorded as unacknowledged:
            # after a death, every queued job with no message anywhere is published again
            queued = session.scalars(select(Job.id).where(Job.status == JobStatus.queued.value, Job.published_at < grace))
            lost.append(Job.id.in_([i for i in queued if i not in present]))
        stranded = list(session.scalars(select(Job).where(Job.status == JobStatus.queued.value, or_(*lost)).limit(5000)))
        published = publish(celery, session, stranded, settings) if stranded else []
    broker.forget(published)
    broker.close()
    if orphans or stranded:
        log.warning("reconciler: %d jobs of dead workers handed back, %d of %d stranded jobs published",
                    orphans, len(published), len(stranded))
    return {"orphans": orphans, "stranded": len(stranded), "published": len(published), "expired": len(expired)}


def cancels_requested(sessions: sessionmaker[Session], name: str) -> list[str]:
    """Jobs the worker `name` runs whose cancel was asked for."""
    with sessions() as session:
        return [str(i) for i in session.scalars(select(Job.id).where(
            Job.status == JobStatus.running.value, Job.worker == name, Job.cancel_requested_at.is_not(None)))]


class Reconciler:
    """The heartbeat-and-sweep thread of one worker process; `stop_jobs` stops runs of this worker's jobs."""

    def __init__(self, sessions: sessionmaker[Session], celery: Celery, settings: Settings, name: str,
                 stop_jobs: Callable[[list[str]], object]) -> None:
        self.sessions, self.celery, self.settings, self.name = sessions, celery, settings, name
        self.stop_jobs = stop_jobs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        beat(self.sessions, self.name)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                beat(self.sessions, self.name)
                if cancelled := cancels_requested(self.sessions, self.name):
                    self.stop_jobs(cancelled)
                reconcile(self.sessions, self.celery, self.settings)
            except Exception:  # the database or broker is away: try again next beat
                log.exception("reconciler sweep failed")
