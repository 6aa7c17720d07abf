"""The task every job message runs: claim the row, run it through the engine, store the outcome."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

from celery import Task
from celery.signals import worker_init, worker_shutdown
from sqlalchemy.orm import Session, sessionmaker

from engine.runner import EngineDead
from jobs.db import make_engine, make_sessions
from jobs.settings import Settings, get_settings
from worker import results
from worker.bridge import Bridge
from worker.celery_app import TASK_RUN_JOB, app

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What one worker process holds for its whole life: the database and the engine."""

    settings: Settings
    sessions: sessionmaker[Session]
    bridge: Bridge
    name: str

    @classmethod
    def start(cls, settings: Settings) -> WorkerContext:
        sessions = make_sessions(make_engine(settings.database_url, pool_size=min(settings.worker_concurrency, 32)))
        bridge = Bridge.from_settings(settings)
        return cls(settings, sessions, bridge, f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}")


@worker_init.connect
def _load_engine(sender=None, **_) -> None:
    # The model is loaded here, in the process that runs it, before the worker consumes anything.
    # The engine thread runs Python between kernels; a short GIL switch interval keeps the consumer and the
    # database threads responsive while it does.
    sys.setswitchinterval(0.0005)
    app.convoq_context = WorkerContext.start(get_settings())
    log.info("engine ready: %s", app.convoq_context.settings.model)


@worker_shutdown.connect
def _close_engine(sender=None, **_) -> None:
    ctx = getattr(app, "convoq_context", None)
    if ctx is not None:
        ctx.bridge.close()


@app.task(name=TASK_RUN_JOB, bind=True)
def run_job(self: Task, job_id: str) -> None:
    ctx: WorkerContext = self.app.convoq_context
    claimed = results.claim(ctx.sessions, job_id, worker=ctx.name)
    if claimed is None:
        log.info("job %s is unknown or already finished; dropping the duplicate message", job_id)
        return
    try:
        outcome = ctx.bridge.run(job_id, claimed.payload)
        results.store(ctx.sessions, claimed, outcome, batch_prefix=ctx.name)
    except EngineDead:
        # the model's state is unknown: exit so the supervisor restarts the worker; unacknowledged
        # messages, this one included, are delivered again
        log.critical("engine thread is dead; exiting")
        os._exit(3)
    except Exception as exc:
        log.exception("job %s failed", job_id)
        results.fail(ctx.sessions, claimed, f"{type(exc).__name__}: {exc}")
