"""The Celery side of a worker process. `worker_app(settings, name)` is the shared app (`broker.app`) with the
job tasks registered, and `Worker` answers Celery's signals. It makes the process's `WorkerContext` when the
worker starts and closes it when it stops.

A message carries one job, or up to `CONVOQ_BULK_GROUP` lines of one batch (`broker.publish`). Its jobs are
claimed in one statement under a lease, run side by side (`worker.runs`), stored in one write and acknowledged
together. Each line is settled on its own, so one that fails fails alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from celery import Celery
from celery.exceptions import Reject
from celery.platforms import EX_OK
from celery.platforms import signals as platform_signals
from celery.signals import (
    after_setup_logger,
    worker_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from celery.utils.log import in_sighandler
from celery.worker import state as worker_state
from celery.worker.control import control_command

from broker.affinity import Advert, by_name, own_queues
from broker.app import CANCEL_COMMAND, create_celery
from engine.interface import EngineStalled, FinishReason
from jobs.queues import TASK_RUN_GROUP, TASK_RUN_JOB
from jobs.settings import Settings
from process.heap import freeze_startup_heap
from worker.bulk_gate import bulk_gate
from worker.context import WorkerContext, engine_died
from worker.exits import NOT_STARTED
from worker.heartbeat import hand_back
from worker.run_ends import record_stall
from worker.runs import run_claims

log = logging.getLogger(__name__)


def worker_name() -> str:
    """This process's row in `workers`: unique per process, and per start of a reused pid."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"


class Worker:
    """A worker process's answers to Celery's signals, and the context its tasks run with, made once the worker
    starts."""

    def __init__(self, settings: Settings, celery: Celery, name: str, queues: list[str] | None = None) -> None:
        self.settings = settings
        self.celery = celery
        self.name = name
        self.advert = Advert.of(settings, queues)  # what its row tells the router it reads
        self.own = set(own_queues(settings, name, queues))  # what a message came from says whether it was sent here
        self.context: WorkerContext | None = None
        self._closing = threading.Lock()
        self._closed = False

    def others(self, sender) -> bool:
        """Whether a worker signal came from another app's worker in this process (Celery's signals are global)."""
        return sender is not None and sender.app is not self.celery

    def start(self, sender=None, **_) -> None:
        """The preflight, before the worker consumes anything. The model is loaded here, in the process that runs
        it, and the database is reached (the first heartbeat). If either fails, the process exits `NOT_STARTED`.
        Celery only logs a receiver of `worker_init` that raises, and would then consume every message it can
        reach and fail each task for want of this context, acknowledging it. The queue would drain into nothing."""
        if self.others(sender):
            return
        try:
            self.context = WorkerContext.start(self.settings, self.celery, self.name, self.advert,
                                               on_stall=self.engine_stalled)
        except Exception as exc:
            log.critical("convoq worker could not start, and consumed nothing: %s", exc, exc_info=True)
            raise SystemExit(NOT_STARTED) from exc
        log.info("engine ready: %s", self.settings.model)

    def ready(self, sender=None, **_) -> None:
        """The worker consumes from now on: what its start built lives as long as it does (`process.heap`). SIGQUIT
        becomes a shutdown with no grace from here (`cold_shutdown`)."""
        if self.others(sender):
            return
        log.info("startup heap frozen: %d objects the collector no longer walks", freeze_startup_heap())
        platform_signals["SIGQUIT"] = self.cold_shutdown

    def cold_shutdown(self, *_) -> None:
        """SIGQUIT stops every run now, and its job goes back (`worker.shutdown`). Then the worker stops as at a
        warm shutdown, which hands back the rest and closes the engine (`stop`). Celery's own cold shutdown does
        neither. It waits out a soft shutdown in the signal handler, cannot cancel a thread's task, and ends
        without `worker_shutdown`. So the jobs waited for their leases, and the exit waited for an engine process
        that ignores the signals meant for its worker."""
        with in_sighandler():
            if self.context is not None:
                self.context.shutdown.begin(cold=True)
            worker_state.should_stop = EX_OK

    def engine_stalled(self, error: EngineStalled) -> None:
        """An engine thread stalled (CONVOQ_ENGINE_PROCESS=false; a process is killed and restarted instead). A
        thread cannot be killed, so the jobs in the engine go back as a stall's (`run_ends.record_stall`), every
        other job this worker holds goes back uncharged, and the worker exits as at the engine's death. They are
        not sent again from here, where this worker would take them before it exits. The sweep sends them."""
        ctx = self.context
        try:
            running = set(ctx.bridge.running())
            record_stall(ctx.sessions, [c for c in ctx.leases.claims() if str(c.job_id) in running],
                            ctx.settings.max_crashes)
            hand_back(ctx.sessions, ctx.name)
        finally:
            engine_died(error)

    def shutting_down(self, how: str = "Warm", **_) -> None:
        """SIGTERM (warm) or SIGQUIT (cold), from the signal handler: the grace begins (`worker.shutdown`)."""
        if self.context is not None:
            self.context.shutdown.begin(cold=how == "Cold")

    def stop(self, sender=None, **_) -> None:
        if self.others(sender):
            return
        with self._closing:  # once, whoever calls it first
            ctx = None if self._closed else self.context
            self._closed = True
        if ctx is None:
            return
        returned = ctx.close()
        if returned:
            log.warning("handed %d unfinished jobs back to the queue", returned)

    def run(self, job_ids: list[str], routing_key: str | None = None) -> None:
        """Run the jobs of a message delivered from the queue `routing_key`, claimed in one statement."""
        ctx = self.context
        if ctx.shutdown.begun.is_set():  # delivered but not started, so the next worker takes it now, not after us
            raise Reject(f"jobs {', '.join(job_ids)} not started: the worker is shutting down", requeue=True)
        claims = []
        for job_id, future in zip(job_ids, ctx.claim.many(job_ids), strict=True):
            try:
                claimed = future.result()
            except Exception:  # this line alone stays queued, and the sweep sends it again
                log.exception("could not claim job %s; the sweep sends it again", job_id)
                continue
            if claimed is None:
                log.info("job %s is not queued (finished, taken, or given up); dropping its message", job_id)
                continue
            ctx.leases.add(claimed)
            claims.append(claimed)
            if claimed.job.conversation_id is not None:
                ctx.metrics.conversation_job(home=routing_key in self.own)
        try:
            run_claims(ctx, claims)
        finally:
            for claimed in claims:
                ctx.leases.drop(claimed)


def worker_app(settings: Settings, name: str, queues: list[str] | None = None) -> Celery:
    """convoq's Celery app with the job task registered and this worker's own queues declared, for `convoq
    worker` as the worker `name` (`worker_name`) consuming `queues` (`--queues`; None: both classes)."""
    celery = create_celery(settings)
    own = own_queues(settings, name, queues)
    celery.conf.task_queues = [*celery.conf.task_queues, *map(by_name, own)]
    own_bulk = [q for q in own if q.startswith(f"{settings.bulk_queue}@")]
    celery.steps["consumer"].add(bulk_gate([settings.bulk_queue, *own_bulk], settings.bulk_share))
    worker = Worker(settings, celery, name, queues)
    worker_init.connect(worker.start, weak=False)
    worker_ready.connect(worker.ready, weak=False)
    worker_shutting_down.connect(worker.shutting_down, weak=False)
    worker_shutdown.connect(worker.stop, weak=False)
    after_setup_logger.connect(quiet_per_task_lines, weak=False)

    # `kind` and `priority` only label the message for Flower and logs (on-call tells a chat from a bulk
    # summary at a glance); what runs is read from the job's row
    @celery.task(name=TASK_RUN_JOB, bind=True)
    def run_job(task, job_id: str, kind: str | None = None, priority: int | None = None) -> None:
        worker.run([job_id], (task.request.delivery_info or {}).get("routing_key"))

    @celery.task(name=TASK_RUN_GROUP, bind=True)
    def run_group(task, job_ids: list[str], kind: str | None = None, priority: int | None = None) -> None:
        worker.run(job_ids, (task.request.delivery_info or {}).get("routing_key"))

    @control_command(name=CANCEL_COMMAND, args=[("job_ids", list), ("reason", str)],
                     signature="<job_ids> [reason]")
    def cancel(state, job_ids: list[str], reason: str = FinishReason.cancelled) -> dict:
        """Stop these jobs if this worker runs them (they end with their text so far)."""
        ctx = worker.context
        return {"stopped": ctx.bridge.stop(job_ids, FinishReason(reason)) if ctx is not None else []}

    return celery


def quiet_per_task_lines(loglevel: int | None = None, **_) -> None:
    """Celery logs a line for every message received and every task that succeeded: at hundreds of jobs a second
    that is noise (a job's life is in its row, in Flower and in the metrics) and about 4% of a worker's CPU. Below
    `--loglevel debug` they are left out; a task that fails still logs its error."""
    if loglevel is None or loglevel > logging.DEBUG:
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)
