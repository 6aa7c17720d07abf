"""Every Celery setting of convoq, in one place. The API imports this too, to publish with the same options.

Start a worker with `convoq worker` (threads pool: many Celery threads feed one engine thread per process,
so the jobs in flight become one batch; CUDA cannot survive a fork, so no prefork pool).
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from jobs.settings import Settings, get_settings


def transport_options(settings: Settings) -> dict:
    return {
        # Ten real priority levels: a queue `q` becomes Redis lists `q`, `q:1` ... `q:9` (0 served first).
        "priority_steps": list(range(10)),
        "sep": ":",
        "queue_order_strategy": "priority",
        # Counted from delivery, not from the start of the run: it must exceed queue wait + run time.
        "visibility_timeout": settings.visibility_timeout,
    }


def create_celery(settings: Settings | None = None) -> Celery:
    settings = settings or get_settings()
    app = Celery("convoq", broker=settings.broker_url, include=["worker.tasks"])
    app.conf.update(
        # JSON only: a pickled message is code execution for whoever can write to the broker.
        task_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        result_serializer="json",
        # Results and timings go to Postgres; Celery's result backend would be a second copy.
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
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


app = create_celery()
