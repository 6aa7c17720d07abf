"""The Celery app factory, shared by the API (publishing), the worker (consuming, reconciling) and Flower. Every
Celery setting of convoq is here, explained.

Nothing here builds an app at import time: callers ask `create_celery(settings)` for one, and the worker
registers its task on its own app (`worker.tasks.worker_app`). Workers run Celery's threads pool: many
Celery threads feed one engine thread per process, so the jobs in flight become one batch; CUDA cannot
survive a fork, so there is no prefork pool.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from broker import redis_transport
from broker.redis_layout import transport_options
from jobs.settings import Settings

# the remote-control command (Celery's broadcast over the broker) that stops jobs wherever they run
CANCEL_COMMAND = "convoq_cancel"


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
    # command (`broker.redis_transport`); other schemes (rediss, sentinel) keep kombu's own
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
