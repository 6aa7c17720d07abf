"""The Celery app factory and the broker's Redis key layout, shared by the API (publishing, metrics), the
worker (consuming, reconciling) and Flower. Every Celery setting of convoq is here, explained.

Nothing here builds an app at import time: callers ask `create_celery(settings)` for one, and the worker
registers its task on its own app (`worker.tasks.worker_app`). Workers run Celery's threads pool: many
Celery threads feed one engine thread per process, so the jobs in flight become one batch; CUDA cannot
survive a fork, so there is no prefork pool.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from jobs.queues import broker_priority
from jobs.settings import Settings

PRIORITY_SEP = ":"
# the remote-control command (Celery's broadcast over the broker) that stops jobs wherever they run
CANCEL_COMMAND = "convoq_cancel"
# kombu's Redis transport keeps each delivered, unacknowledged message in this hash, indexed by delivery time
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"


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


def progress_channel(job_id: str) -> str:
    """The Redis pub/sub channel of a job's progress events (`worker.progress` publishes, the API's
    `/v1/jobs/{id}/events` subscribes). Events are JSON: `{"event": "status", "status": ...}` and
    `{"event": "text", "text": <all of it so far>, "tokens": n}`."""
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
        # Events feed Flower's task list; the sent event lets it show jobs that still wait.
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_soft_shutdown_timeout=30.0,
    )
    return app
