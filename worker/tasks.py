"""The task every job message runs: claim the row, run it through the engine, store the outcome."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from celery import Celery, Task
from celery.signals import worker_init, worker_shutdown
from sqlalchemy.orm import Session, sessionmaker

from engine.runner import EngineDead
from jobs.db import make_engine, make_sessions
from jobs.group_commit import GroupCommit
from jobs.publish import publish
from jobs.queues import TASK_RUN_JOB
from jobs.settings import Settings, get_settings
from jobs.tables import Job
from worker import results
from worker.bridge import Bridge
from worker.celery_app import app
from worker.metrics import WorkerMetrics
from worker.payload import Outcome
from worker.reconciler import Reconciler, hand_back

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What one worker process holds for its whole life: the database, the engine, the reconciler."""

    settings: Settings
    sessions: sessionmaker[Session]
    bridge: Bridge
    reconciler: Reconciler
    name: str
    metrics: WorkerMetrics
    claim: GroupCommit[str, results.Claimed | None]  # job id -> the claimed job, or None: not queued
    store: GroupCommit[tuple[results.Claimed, Outcome], results.Stored]

    @classmethod
    def start(cls, settings: Settings, celery: Celery) -> WorkerContext:
        # every write here retries on a dropped connection (`results.retrying`), so no ping per checkout
        engine = make_engine(settings.database_url, pool_size=min(settings.worker_concurrency, 32), pre_ping=False)
        sessions = make_sessions(engine)
        bridge = Bridge.from_settings(settings)
        name = f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"
        reconciler = Reconciler(sessions, celery, settings, name).start()
        metrics = WorkerMetrics.start(settings.worker_metrics_port, bridge.runner.stats)
        claim = GroupCommit(lambda ids: results.claim_many(sessions, ids, name, settings.max_attempts), "claims")
        store = GroupCommit(lambda done: results.store_many(sessions, done, batch_prefix=name), "stores")
        return cls(settings, sessions, bridge, reconciler, name, metrics, claim, store)

    def close(self) -> None:
        self.reconciler.stop()
        self.bridge.close()
        self.claim.close()
        self.store.close()


@worker_init.connect
def _start(sender=None, **_) -> None:
    # The model is loaded here, in the process that runs it, before the worker consumes anything.
    app.convoq_context = WorkerContext.start(get_settings(), app)
    log.info("engine ready: %s", app.convoq_context.settings.model)


@worker_shutdown.connect
def _stop(sender=None, **_) -> None:
    ctx: WorkerContext | None = getattr(app, "convoq_context", None)
    if ctx is None:
        return
    ctx.close()
    returned = hand_back(ctx.sessions, ctx.name)
    if returned:
        log.warning("handed %d unfinished jobs back to the queue", returned)


@app.task(name=TASK_RUN_JOB, bind=True)
def run_job(self: Task, job_id: str) -> None:
    ctx: WorkerContext = self.app.convoq_context
    claimed = ctx.claim(job_id)
    if claimed is None:
        log.info("job %s is not queued (finished, taken, or given up); dropping this message", job_id)
        return
    try:
        outcome = ctx.bridge.run(job_id, claimed.payload)
        if outcome.completion.retryable:
            raise RuntimeError(outcome.completion.error)
        stored = ctx.store((claimed, outcome))
        ctx.metrics.observe(claimed.payload["priority"], stored, len(outcome.completion.token_ids))
    except EngineDead:
        # the model's state is unknown: exit so the supervisor restarts the worker; the reconciler hands this
        # worker's jobs back once its heartbeat has stopped
        log.critical("engine thread is dead; exiting")
        os._exit(3)
    except Exception as exc:
        log.exception("job %s failed (attempt %d of %d)", job_id, claimed.attempt, ctx.settings.max_attempts)
        retry_or_fail(ctx, claimed, f"{type(exc).__name__}: {exc}")


def retry_or_fail(ctx: WorkerContext, claimed: results.Claimed, error: str) -> None:
    """Try again later with exponential backoff while attempts remain; then the job fails with its error."""
    s = ctx.settings
    if claimed.attempt >= s.max_attempts:
        results.fail(ctx.sessions, claimed, f"failed after {claimed.attempt} attempts: {error}")
        ctx.metrics.gave_up()
        return
    if results.requeue(ctx.sessions, claimed, error):
        ctx.metrics.retried()
        with ctx.sessions() as session:
            job = session.get(Job, claimed.job_id)
            publish(app, session, [job], s, countdown=s.retry_backoff_s * 2 ** (claimed.attempt - 1))
