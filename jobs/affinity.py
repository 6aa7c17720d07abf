"""Prefix affinity: a conversation's turns go to the worker whose prefix cache holds its earlier turns.

Celery hands a message to whichever worker is free, so with N workers a turn finds its history cached about 1/N
of the time. So each worker also consumes queues of its own (`jobs.queues.home_queue`, one per class), and a job
with a `conversation_id` is published to its home: the worker that ran the conversation's last turn if that
worker is alive, else a live worker placed by rendezvous hashing with bounded loads: the first worker in the
conversation's hash order that has been given fewer than `BALANCE` times the mean of new conversations. A worker
that joins or leaves moves no conversation whose worker lives, and hashing alone would leave some worker with
half again its share of a few dozen conversations as often as not. A home queue that already has
`affinity_max_waiting` messages of the job's class waiting means a saturated worker: the job goes to the shared
queue, where any worker serves it. The sweep moves what a gone worker's queues still hold back to the shared
queues (`jobs.broker.BrokerView.rehome`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kombu import Exchange, Queue
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from jobs.clock import db_now
from jobs.queues import home_queue
from jobs.settings import Settings
from jobs.tables import Job, Worker

log = logging.getLogger(__name__)
LIVE_TTL_S = 2.0  # how long one read of the live workers serves a process's publishes
CHUNK = 1000  # conversations per read of their last workers
BALANCE = 1.25  # no worker is given over this times the mean of the new conversations
RECENT = 100_000  # conversations placed, remembered until their first turn is taken


def affinity_on(settings: Settings) -> bool:
    """Whether jobs are routed to their conversation's worker: `CONVOQ_AFFINITY`, on a Redis broker only, the
    one whose queues the sweep can read and move (a gone worker's own queue would wait on any other broker)."""
    return settings.affinity and settings.broker_url.get_secret_value().startswith(("redis://", "rediss://"))


def own_queues(settings: Settings, name: str) -> list[str]:
    """The queues only the worker `name` consumes, one per class; none with affinity off."""
    if not affinity_on(settings):
        return []
    return [home_queue(settings.interactive_queue, name), home_queue(settings.bulk_queue, name)]


def consumed_queues(settings: Settings, name: str, queues: list[str] | None = None) -> list[str]:
    """What the worker `name` consumes, most urgent first: each shared queue of `queues` (default both) right
    after its own queue of that class, which wins on equal broker priority (BRPOP serves the first listed)."""
    listed = queues or [settings.interactive_queue, settings.bulk_queue]
    own = dict(zip((settings.interactive_queue, settings.bulk_queue), own_queues(settings, name), strict=False))
    return [q for shared in listed for q in ([own[shared]] if shared in own else []) + [shared]]


def live_workers(session: Session, dead_after_s: float) -> list[str]:
    """The workers that beat within a lease and have not stopped (the rows' names)."""
    workers = Worker.__table__
    return list(session.scalars(select(workers.c.name).where(
        workers.c.stopped_at.is_(None), workers.c.heartbeat_at >= db_now(-dead_after_s)).order_by(workers.c.name)))


def rank(key: str, worker: str) -> bytes:
    """Rendezvous hashing: a key's workers in the order of this hash stay in that order whoever joins or leaves,
    and a worker joining comes first for about 1/N of the keys, taken from every other worker alike."""
    return hashlib.blake2b(f"{key}\x00{worker}".encode(), digest_size=8).digest()


def direct_queue(name: str) -> Queue:
    """A queue as Celery declares the shared ones (`task_queues`): a direct exchange of its own name."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


class Router:
    """Picks the home worker of each job with a conversation, for `jobs.publish.publish`. One per process: it
    keeps the live workers for `LIVE_TTL_S` (a worker that died meanwhile leaves its messages to the sweep), and
    the conversations it placed, so that a turn sent before the last one was taken follows it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._live: tuple[float, list[str]] = (float("-inf"), [])  # (read until, names)
        self._placed: Counter[str] = Counter()  # worker -> conversations placed on it by this process
        self._recent: OrderedDict[tuple[str | None, str], str] = OrderedDict()  # conversation -> worker placed on
        self._lock = threading.Lock()  # the API publishes from many threads

    def homes(self, session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, str]:
        """Job id -> the worker it should run on, for the jobs with a conversation (none if affinity is off or no
        worker is alive). A failed read only costs the affinity: the jobs go to the shared queues."""
        talking = [job for job in jobs if job.conversation_id is not None]
        if not talking or not affinity_on(self.settings):
            return {}
        try:
            live = self._live_workers(session)
            if not live:
                return {}
            last = last_workers(session, talking)
        except SQLAlchemyError:
            session.rollback()
            log.warning("could not read the conversations' workers; %d jobs go to the shared queues",
                        len(talking), exc_info=True)
            return {}
        alive = set(live)
        homes = {}
        with self._lock:
            for job in talking:
                key = (job.tenant, job.conversation_id)
                known = (w for w in (last.get(key), self._recent.get(key)) if w in alive)
                homes[job.id] = next(known, None) or self._place(key, live)
        return homes

    def _place(self, key: tuple[str | None, str], live: list[str]) -> str:
        if set(self._placed) - set(live) or set(live) - set(self._placed):
            # the workers changed: count afresh, or a newcomer at 0 would take every new conversation for a while
            self._placed = Counter(dict.fromkeys(live, 0))
        cap = math.ceil(BALANCE * (sum(self._placed[w] for w in live) + 1) / len(live))
        order = sorted(live, key=lambda w: rank(f"{key[0]}/{key[1]}", w), reverse=True)
        worker = next(w for w in order if self._placed[w] < cap)  # the least placed is always below the cap
        self._placed[worker] += 1
        self._recent[key] = worker
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return worker

    def _live_workers(self, session: Session) -> list[str]:
        until, names = self._live
        now = time.monotonic()
        if now >= until:
            names = live_workers(session, self.settings.dead_after_s)
            self._live = (now + LIVE_TTL_S, names)
        return names


def last_workers(session: Session, jobs: Sequence[Job]) -> dict[tuple[str | None, str], str]:
    """(tenant, conversation id) -> the worker that took the conversation's latest job (running or ended)."""
    c = Job.__table__.c
    latest = func.row_number().over(partition_by=(c.tenant, c.conversation_id), order_by=c.created_at.desc())
    conversations = sorted({job.conversation_id for job in jobs})
    found = {}
    for start in range(0, len(conversations), CHUNK):  # a batch's lines may name thousands
        ranked = (select(c.tenant, c.conversation_id, c.worker, latest.label("n"))
                  .where(c.conversation_id.in_(conversations[start:start + CHUNK]), c.worker.is_not(None))
                  .subquery())
        rows = session.execute(select(ranked.c.tenant, ranked.c.conversation_id, ranked.c.worker)
                               .where(ranked.c.n == 1))
        found.update({(tenant, conversation): worker for tenant, conversation, worker in rows})
    return found


class Waiting:
    """Messages waiting in home queues during one publish: each queue's length read once, then counted on."""

    def __init__(self, channel: object, bound: int) -> None:
        self.channel, self.bound = channel, bound
        self.counts: dict[str, int] = {}

    def room(self, queue: str) -> bool:
        """Whether `queue` takes one more message (and count it if so)."""
        if queue not in self.counts:
            # kombu's virtual transports (Redis, SQLAlchemy) count a queue's messages over its priority lists;
            # one that cannot be counted is full: affinity is a saving, never a reason not to publish
            try:
                self.counts[queue] = self.channel._size(queue)
            except Exception:
                log.warning("could not count the messages waiting in %s; sending to the shared queue", queue,
                            exc_info=True)
                self.counts[queue] = self.bound
        if self.counts[queue] >= self.bound:
            return False
        self.counts[queue] += 1
        return True
