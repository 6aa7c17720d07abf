"""Prefix affinity: a conversation's turns go to the worker whose prefix cache holds its earlier turns.

Celery hands a message to whichever worker is free, so with N workers a turn finds its history cached about 1/N
of the time. So each worker also consumes queues of its own (`jobs.queues.home_queue`, one per class), and a job
with a `conversation_id` is published to its home: the worker that ran the conversation's last turn if that
worker is alive, else a live worker placed by rendezvous hashing with bounded loads: the first worker in the
conversation's hash order that has been given fewer than `BALANCE` times the mean of new conversations. A worker
that joins or leaves moves no conversation whose worker lives, and hashing alone would leave some worker with
half again its share of a few dozen conversations as often as not. Only a worker that reads the job's queue is a
home: one that beats, is not draining (its shutdown has begun), takes conversations (`CONVOQ_AFFINITY` on) and
consumes the job's class (`--queues`), as its `workers` row says (`Advert`). A home queue that already has
`affinity_max_waiting` messages of the job's class waiting means a saturated worker: the job goes to the shared
queue, where any worker serves it. The sweep moves what a gone worker's queues still hold back to the shared
queues (`broker.view.BrokerView.rehome`).
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
from dataclasses import dataclass

from kombu import Exchange, Queue
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from broker.redis_layout import is_redis
from jobs.queues import home_queue, is_interactive
from jobs.settings import Settings
from jobs.tables import Job, Worker
from store.workers import alive

log = logging.getLogger(__name__)
LIVE_TTL_S = 2.0  # how long one read of the live workers serves a process's publishes
CHUNK = 1000  # conversations per read of their last workers
BALANCE = 1.25  # no worker is given over this times the mean of the new conversations
RECENT = 100_000  # conversations placed, remembered until their first turn is taken


def affinity_on(settings: Settings) -> bool:
    """Whether jobs are routed to their conversation's worker: `CONVOQ_AFFINITY`, on a Redis broker only, the
    one whose queues the sweep can read and move (a gone worker's own queue would wait on any other broker)."""
    return settings.affinity and is_redis(settings)


CLASSES = ("interactive", "bulk")  # the classes of work, by the shared queue each has (`jobs.queues.queue_for`)


def shared_queues(settings: Settings) -> dict[str, str]:
    """Each class -> its shared queue."""
    return dict(zip(CLASSES, (settings.interactive_queue, settings.bulk_queue), strict=True))


def classes_of(settings: Settings, queues: list[str] | None) -> list[str]:
    """The classes a worker consuming `queues` (`--queues`; None: both shared queues) serves."""
    return [c for c, shared in shared_queues(settings).items() if queues is None or shared in queues]


def own_queues(settings: Settings, name: str, queues: list[str] | None = None) -> list[str]:
    """The queues only the worker `name` consumes, one per class it serves (`queues`, as `classes_of`); none with
    affinity off. A class it does not serve has no own queue: nothing could be routed there that it would read."""
    if not affinity_on(settings):
        return []
    shared = shared_queues(settings)
    return [home_queue(shared[c], name) for c in classes_of(settings, queues)]


def consumed_queues(settings: Settings, name: str, queues: list[str] | None = None) -> list[str]:
    """What the worker `name` consumes, most urgent first: each shared queue of `queues` (default both) right
    after its own queue of that class, which wins on equal broker priority (BRPOP serves the first listed)."""
    listed = queues or [settings.interactive_queue, settings.bulk_queue]
    own = set(own_queues(settings, name, queues))
    return [q for shared in listed for q in (home_queue(shared, name), shared) if q == shared or q in own]


@dataclass(frozen=True)
class Advert:
    """What a worker's row says of the jobs it reads (`workers.classes`, `workers.affinity`), stamped at each beat."""

    classes: tuple[str, ...]  # of `CLASSES`: the classes of its own queues it consumes
    affinity: bool  # it has own queues: conversations may be routed to it

    @classmethod
    def of(cls, settings: Settings, queues: list[str] | None) -> Advert:
        """The advert of a worker with these settings consuming `queues` (`--queues`; None: both classes)."""
        return cls(tuple(classes_of(settings, queues)), affinity_on(settings))

    def columns(self) -> dict:
        return {"classes": ",".join(self.classes), "affinity": self.affinity}


@dataclass(frozen=True)
class Home:
    """A worker a conversation may be routed to, and the classes of its own queues it reads."""

    name: str
    classes: frozenset[str]


def homes_open(session: Session, dead_after_s: float) -> list[Home]:
    """The workers a conversation's job may be routed to: alive (`store.workers.alive`), not draining, taking
    conversations; each with the classes it consumes (a row from before `workers.classes` existed: both)."""
    w = Worker.__table__.c
    rows = session.execute(select(w.name, w.classes).where(
        alive(dead_after_s), w.draining_at.is_(None), w.affinity.is_(True)).order_by(w.name))
    return [Home(name, frozenset(CLASSES if classes is None else filter(None, classes.split(","))))
            for name, classes in rows]


def rank(key: str, worker: str) -> bytes:
    """Rendezvous hashing: a key's workers in the order of this hash stay in that order whoever joins or leaves,
    and a worker joining comes first for about 1/N of the keys, taken from every other worker alike."""
    return hashlib.blake2b(f"{key}\x00{worker}".encode(), digest_size=8).digest()


def by_name(name: str) -> Queue:
    """A worker's own queue as Celery declares and publishes to it: reached by its name alone (the default
    exchange), so that no exchange binding (`_kombu.binding.<queue>` in Redis) is stored for it: a worker's start
    would otherwise leave one key per own queue behind for good. A message's delivery info then names the queue
    itself, where a consumer that dies with it restores it."""
    return Queue(name, Exchange(""), routing_key=name)


class Router:
    """Picks the home worker of each job with a conversation, for `broker.publish.publish`. One per process: it
    keeps the open homes for `LIVE_TTL_S` (a worker that died or began draining meanwhile leaves its messages to
    the sweep), and the conversations it placed, so that a turn sent before the last one was taken follows it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._live: tuple[float, list[Home]] = (float("-inf"), [])  # (read until, homes)
        self._placed: Counter[str] = Counter()  # worker -> conversations placed on it by this process
        self._recent: OrderedDict[tuple[str | None, str], str] = OrderedDict()  # conversation -> worker placed on
        self._lock = threading.Lock()  # the API publishes from many threads

    def homes(self, session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, str]:
        """Job id -> the worker it should run on, for the jobs with a conversation whose class some open home
        consumes (none if affinity is off). A failed read only costs the affinity: the jobs go to the shared
        queues."""
        talking = [job for job in jobs if job.conversation_id is not None]
        if not talking or not affinity_on(self.settings):
            return {}
        try:
            live = self._open_homes(session)
            if not live:
                return {}
            last = last_workers(session, talking)
        except SQLAlchemyError:
            session.rollback()
            log.warning("could not read the conversations' workers; %d jobs go to the shared queues",
                        len(talking), exc_info=True)
            return {}
        reading = {c: [h.name for h in live if c in h.classes] for c in CLASSES}
        homes = {}
        with self._lock:
            self._count_afresh_if_changed([h.name for h in live])
            for job in talking:
                key, cls = (job.tenant, job.conversation_id), job_class(job, self.settings)
                if not (candidates := reading[cls]):
                    continue  # no home reads this class: the shared queue
                known = (w for w in (last.get(key), self._recent.get(key)) if w in candidates)
                homes[job.id] = next(known, None) or self._place(key, candidates)
        return homes

    def _count_afresh_if_changed(self, live: list[str]) -> None:
        if set(self._placed) != set(live):
            # the workers changed: count afresh, or a newcomer at 0 would take every new conversation for a while
            self._placed = Counter(dict.fromkeys(live, 0))

    def _place(self, key: tuple[str | None, str], candidates: list[str]) -> str:
        cap = math.ceil(BALANCE * (sum(self._placed[w] for w in candidates) + 1) / len(candidates))
        order = sorted(candidates, key=lambda w: rank(f"{key[0]}/{key[1]}", w), reverse=True)
        worker = next(w for w in order if self._placed[w] < cap)  # the least placed is always below the cap
        self._placed[worker] += 1
        self._recent[key] = worker
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return worker

    def _open_homes(self, session: Session) -> list[Home]:
        until, homes = self._live
        now = time.monotonic()
        if now >= until:
            homes = homes_open(session, self.settings.dead_after_s)
            self._live = (now + LIVE_TTL_S, homes)
        return homes


def job_class(job: Job, settings: Settings) -> str:
    """A job's class, as its priority sends it to a shared queue (`jobs.queues.queue_for`)."""
    return "interactive" if is_interactive(job.priority, settings) else "bulk"


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
