"""The Celery app factory, the broker's Redis key layout and a view of the messages in it, shared by the API
(publishing, metrics), the worker (consuming, reconciling) and Flower. Every Celery setting of convoq is here,
explained.

Nothing here builds an app at import time: callers ask `create_celery(settings)` for one, and the worker
registers its task on its own app (`worker.tasks.worker_app`). Workers run Celery's threads pool: many
Celery threads feed one engine thread per process, so the jobs in flight become one batch; CUDA cannot
survive a fork, so there is no prefork pool.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import redis
from celery import Celery
from kombu import Queue

from jobs import redis_transport
from jobs.queues import HOME_SEP, broker_priority
from jobs.settings import Settings

PRIORITY_SEP = ":"
# the remote-control command (Celery's broadcast over the broker) that stops jobs wherever they run
CANCEL_COMMAND = "convoq_cancel"
# kombu's Redis transport keeps each delivered, unacknowledged message in this hash, indexed by delivery time
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
# the message header that lists the jobs of a grouped message (`jobs.publish`): the broker's view finds each of
# them there without decoding the body
GROUP_HEADER = "convoq_jobs"


def transport_options(settings: Settings) -> dict:
    return {
        # Ten real priority levels: a queue `q` becomes Redis lists `q`, `q:1` ... `q:9` (0 served first).
        "priority_steps": list(range(10)),
        "sep": PRIORITY_SEP,
        "queue_order_strategy": "priority",
        # Counted from delivery, not from the start of the run: it must exceed queue wait + run time.
        "visibility_timeout": settings.visibility_timeout,
    }


def priority_list(queue: str, priority: int) -> str:
    """The Redis list that holds `queue`'s messages of our `priority` (broker level 0 is the bare name)."""
    level = broker_priority(priority)
    return f"{queue}{PRIORITY_SEP}{level}" if level else queue


def queue_lists(settings: Settings) -> dict[str, list[str]]:
    """Each of our queues -> its ten Redis lists, by our priority 0..9."""
    return {queue: [priority_list(queue, p) for p in range(10)]
            for queue in (settings.interactive_queue, settings.bulk_queue)}


PAGE = 1000  # messages read per Redis call


def home_lists(client: redis.Redis, settings: Settings) -> dict[str, list[str]]:
    """Each shared queue -> the Redis lists of every worker's own queue of its class (`jobs.queues.home_queue`,
    every priority), gone workers' included: only those holding messages exist."""
    return {queue: sorted(key.decode() for key in client.scan_iter(f"{queue}{HOME_SEP}*", count=PAGE))
            for queue in (settings.interactive_queue, settings.bulk_queue)}


def message_headers(raw: bytes) -> dict:
    """The headers of a message as Kombu's Redis transport keeps it: a queue list holds the message's JSON, the
    `unacked` hash `[message, exchange, routing key]`. Celery puts the task id (our job id) in `id`, and a
    retry's countdown in `eta` (an ISO time). Anything else found there has no headers."""
    try:
        message = json.loads(raw)
    except ValueError:
        return {}
    if isinstance(message, list):
        message = message[0] if message else None
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers if isinstance(headers, dict) else {}


def job_ids_of(headers: dict) -> list[uuid.UUID]:
    """The jobs a message carries: a grouped message's list (`GROUP_HEADER`), else its task id (the job id)."""
    try:
        return [uuid.UUID(i) for i in headers.get(GROUP_HEADER) or [headers["id"]]]
    except (KeyError, TypeError, ValueError, AttributeError):
        return []


def eta_of(headers: dict) -> float | None:
    """A retry's ETA as a Unix time; None without one."""
    try:
        moment = datetime.fromisoformat(headers["eta"])
    except (KeyError, TypeError, ValueError):
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


class BrokerView:
    """Which jobs have a message in Kombu's Redis transport (task id = job id).

    A waiting message sits in one of the queues' priority lists; a delivered, unacknowledged one in the
    `unacked` hash, indexed by delivery time in `unacked_index`. A delivered message counts as held by a consumer
    that can still claim it for `held_for_s` after delivery (a live worker claims the moment it receives;
    a retry's message waits for its ETA first); after that its consumer is gone. Once a job is sent again, the
    stale `unacked` entries for it are dropped, so that Kombu never restores a second copy.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        redis_url = settings.broker_url.get_secret_value().startswith(("redis://", "rediss://"))
        self.client = redis.Redis.from_url(settings.broker_url.get_secret_value()) if redis_url else None
        self.stale: dict[uuid.UUID, list[bytes]] = {}

    def live(self, held_for_s: float) -> set[uuid.UUID] | None:
        """Every job with a live message; None if the broker cannot be read this way."""
        if self.client is None:
            return None
        present: set[uuid.UUID] = set()
        shared = (n for names in queue_lists(self.settings).values() for n in names)
        for name in [*shared, *self._home_lists()]:
            # Producers push at the head and consumers pop at the tail: paging from the head can see a message
            # twice, never miss one that stays
            start = 0
            while page := self.client.lrange(name, start, start + PAGE - 1):
                present.update(i for raw in page for i in job_ids_of(message_headers(raw)))
                start += PAGE
        now, cursor = time.time(), 0
        while True:
            cursor, entries = self.client.hscan(UNACKED_KEY, cursor, count=PAGE)
            delivered = dict(zip(entries, self.client.zmscore(UNACKED_INDEX_KEY, list(entries)), strict=True)) \
                if entries else {}
            for tag, raw in entries.items():
                headers = message_headers(raw)
                at = delivered[tag] or 0.0
                held = now - at < held_for_s or (eta_of(headers) or 0.0) > now - held_for_s
                for job_id in job_ids_of(headers):
                    if held:
                        present.add(job_id)
                    else:  # a stale group is dropped once any of its jobs is sent again: the others are
                        self.stale.setdefault(job_id, []).append(tag)  # not live, so sent in the same sweep
            if cursor == 0:
                return present

    def _home_lists(self) -> list[str]:
        return [name for names in home_lists(self.client, self.settings).values() for name in names]

    def rehome(self, gone: Callable[[str, str], bool]) -> int:
        """Move the messages waiting in the own queues that are `gone` (by the shared queue of their class and
        their worker part, `jobs.queues.home_tag`: a worker gone, draining, or not consuming that class) to the
        shared queue of their class, at the same priority; returns how many moved. They keep their order and
        their turn: served next, oldest first, as they would have been from the own queue, which its worker
        served before the shared one. Each message is rewritten to say it was routed to the shared queue, so
        that a consumer that dies with it restores it there. One message at a time, popped then pushed: one lost
        between the two (this process killed) is a queued job without a message, which the sweep sends again."""
        if self.client is None:
            return 0
        moved = 0
        for name in self._home_lists():
            queue, _, rest = name.partition(HOME_SEP)
            worker, _, level = rest.partition(PRIORITY_SEP)
            if not gone(queue, worker):
                continue
            target = f"{queue}{PRIORITY_SEP}{level}" if level else queue
            # producers push at the head and consumers pop at the tail: the newest goes first to the tail, and
            # each older one after it, nearer the end served first
            while (raw := self.client.lpop(name)) is not None:
                self.client.rpush(target, routed_to(raw, queue))
                moved += 1
        return moved

    def forget(self, job_ids: list[uuid.UUID]) -> None:
        tags = list(dict.fromkeys(tag for i in job_ids for tag in self.stale.get(i, [])))
        if self.client is not None and tags:
            self.client.pipeline().zrem(UNACKED_INDEX_KEY, *tags).hdel(UNACKED_KEY, *tags).execute()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def routed_to(raw: bytes, queue: str) -> bytes:
    """A message of Kombu's Redis transport, as if it had been published to `queue` (its delivery info is where
    a consumer restores it to, and what `worker.bulk_gate` tells bulk by)."""
    try:
        message = json.loads(raw)
        message["properties"]["delivery_info"].update(exchange=queue, routing_key=queue)
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw
    return json.dumps(message).encode()


def progress_channel(job_id: str) -> str:
    """The Redis pub/sub channel of a job's progress events (`worker.progress` publishes, the API's
    `/v1/jobs/{id}/events` subscribes). Events are JSON: `{"event": "status", "status": ...}` and
    `{"event": "text", "text": <all of it so far>, "tokens": n, "run": <the lease of the run that made it>}`."""
    return f"convoq:progress:{job_id}"


def broadcast_cancel(celery: Celery, job_ids: list[str], reason: str = "cancelled") -> None:
    """Ask every worker to stop these jobs if it runs them (fire and forget: a worker that misses it finds
    the request in the job's row at its next heartbeat)."""
    celery.control.broadcast(CANCEL_COMMAND, arguments={"job_ids": job_ids, "reason": reason})


def worker_node_name(pid: int) -> str:
    """The Celery node name of the worker process `pid` (`%h`: Celery puts the host name in). Workers on one
    host (one per GPU) must not share one: remote control replies (cancels, Flower's inspect) and worker
    events are told apart by it, and Celery warns of a duplicate and mixes them up."""
    return f"convoq-{pid}@%h"


def create_celery(settings: Settings) -> Celery:
    # redis:// takes kombu's Redis transport keeping a Redis client per channel instead of building one per
    # command (`jobs.redis_transport`); other schemes (rediss, sentinel) keep kombu's own
    redis_transport.install()
    app = Celery("convoq", broker=settings.broker_url.get_secret_value())
    app.conf.update(
        # JSON only: a pickled message is code execution for whoever can write to the broker.
        task_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        result_serializer="json",
        # Results and timings go to Postgres; Celery's result backend would be a second copy.
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        # With no result backend the (disabled) backend object holds no state, so the threads can share it.
        # Otherwise Celery builds one per pool thread on that thread's first task, by scanning every
        # installed package's entry points: tens of ms each, for each of the 256 threads.
        result_backend_thread_safe=True,
        # At-least-once: ack only after the result is stored; a killed worker's jobs come back.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Priority is looked at only when a message is fetched; prefetching more than the threads can hold
        # would freeze the order of messages that wait behind busy threads.
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        worker_pool="threads",
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_queues=[Queue(settings.interactive_queue), Queue(settings.bulk_queue)],
        task_default_queue=settings.interactive_queue,
        task_create_missing_queues=False,
        # The workers' events feed Flower's task list, each task from the moment a worker receives it. No event
        # at send: it would be a second publish per submission (a tenth of the API's CPU per job); the jobs that
        # still wait show in Flower's queue lengths and the API's metrics.
        worker_send_task_events=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        # A cold shutdown (SIGQUIT) lets running tasks go on this long before Celery cancels them; a warm one
        # (SIGTERM: a deploy) has convoq's own limit instead, `CONVOQ_SHUTDOWN_GRACE_S` (`worker.shutdown`).
        worker_soft_shutdown_timeout=30.0,
    )
    return app
