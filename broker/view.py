"""Which jobs have a message in the broker, read from kombu's Redis transport, and the moves the sweep makes
there: own queues of gone workers emptied into the shared ones, stale deliveries dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import redis

from broker.redis_layout import (
    PAGE,
    PRIORITY_SEP,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
    home_lists,
    is_redis,
    queue_lists,
)
from jobs.queues import HOME_SEP
from jobs.settings import Settings

# the message header that lists the jobs of a grouped message (`broker.publish`): the broker's view finds each of
# them there without decoding the body
GROUP_HEADER = "convoq_jobs"


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
        self.client = redis.Redis.from_url(settings.broker_url.get_secret_value()) if is_redis(settings) else None
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
