"""A Redis broker: whether the broker is one, and where kombu's Redis transport keeps what in it (each queue's
priority lists, the delivered messages, the progress channels), read by the reconciler's sweep and the metrics.
"""

from __future__ import annotations

import redis

from jobs.priority import HIGHEST, LEVELS
from jobs.queues import HOME_SEP
from jobs.settings import Settings

PRIORITY_SEP = ":"
# kombu's Redis transport keeps each delivered, unacknowledged message in this hash, indexed by delivery time
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
PAGE = 1000  # messages read per Redis call


def is_redis(settings: Settings) -> bool:
    """Whether the broker is Redis (plain or over TLS): the one whose keys the sweep, the metrics and
    `convoq doctor` read, and whose own queues affinity needs. Other kombu transports are only published to."""
    return settings.broker_url.get_secret_value().startswith(("redis://", "rediss://"))


def transport_options(settings: Settings) -> dict:
    return {
        # A real level for each of ours: a queue `q` becomes Redis lists `q`, `q:1` ... `q:9` (0 served first).
        "priority_steps": sorted(broker_priority(p) for p in LEVELS),
        "sep": PRIORITY_SEP,
        "queue_order_strategy": "priority",
        # Counted from delivery, not from the start of the run: it must exceed queue wait + run time.
        "visibility_timeout": settings.visibility_timeout,
    }


def broker_priority(priority: int) -> int:
    """Ours: `HIGHEST` is the most urgent. Celery's Redis transport serves priority 0 first."""
    return HIGHEST - priority


def priority_list(queue: str, priority: int) -> str:
    """The Redis list that holds `queue`'s messages of our `priority` (broker level 0 is the bare name)."""
    level = broker_priority(priority)
    return f"{queue}{PRIORITY_SEP}{level}" if level else queue


def queue_lists(settings: Settings) -> dict[str, list[str]]:
    """Each of our queues -> its Redis lists, by our priority, lowest first."""
    return {queue: [priority_list(queue, p) for p in LEVELS]
            for queue in (settings.interactive_queue, settings.bulk_queue)}


def home_lists(client: redis.Redis, settings: Settings) -> dict[str, list[str]]:
    """Each shared queue -> the Redis lists of every worker's own queue of its class (`jobs.queues.home_queue`,
    every priority), gone workers' included: only those holding messages exist."""
    return {queue: sorted(key.decode() for key in client.scan_iter(f"{queue}{HOME_SEP}*", count=PAGE))
            for queue in (settings.interactive_queue, settings.bulk_queue)}


def progress_channel(job_id: str) -> str:
    """The Redis pub/sub channel of a job's progress events (`worker.progress` publishes, the API's
    `/v1/jobs/{id}/events` subscribes). Events are JSON: `{"event": "status", "status": ...}` and
    `{"event": "text", "text": <all of it so far>, "tokens": n, "run": <the lease of the run that made it>}`."""
    return f"convoq:progress:{job_id}"
