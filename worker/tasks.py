"""The tasks job messages run: claim the rows under a lease, run the jobs by their kind through the engine,
store the outcomes (only while the lease is still the run's). A message carries one job, or up to
`CONVOQ_BULK_GROUP` lines of one batch (`broker.publish`): those are claimed in one statement, run side by side,
stored in one write and acknowledged together, each line settled on its own (one that fails fails alone).

`worker_app(settings, name)` is the Celery app of a worker process: the shared app (`broker.app`) with this task
registered, and the process's context (database, engine, reconciler, metrics) created when the worker starts.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

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
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Advert, Router, by_name, own_queues
from broker.app import CANCEL_COMMAND, create_celery
from broker.publish import publish
from broker.view import BrokerView
from engine.interface import Completion, EngineDead, EngineStalled, FinishReason
from jobs.chat import chat_for, chat_problem
from jobs.queues import TASK_RUN_GROUP, TASK_RUN_JOB, home_tag
from jobs.schemas import ErrorCode, JobIn, JobStatus
from jobs.settings import Settings
from jobs.tables import Job
from jobs.tool_calls import tool_use
from process.heap import freeze_startup_heap
from store.connections import make_db_engine, make_sessions
from worker import results
from worker.bridge import Bridge, JobRun
from worker.bulk_gate import bulk_gate
from worker.engine_factory import start_engine
from worker.exits import NOT_STARTED
from worker.group_commit import GroupCommit
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.outcome import Outcome
from worker.progress import ProgressPublisher
from worker.reconciler import Reconciler, hand_back, mark_draining
from worker.shutdown import Shutdown
from worker.solo import Solo
from worker.summarize import merged_timings, summarize
from worker.usage import cpu_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Asked:
    """A chat job's requests, in the engine since `start`: a future per choice."""

    start: float
    choices: list[Future[Completion]]


def ask(run: JobRun) -> Asked | Outcome:
    """A chat job's requests into the engine: one per choice (`n`), its prompt and output within the model's
    context; or, when they are not, the job's failure."""
    start = time.monotonic()
    prompt = run.prompt_ids(chat_for(run.job))
    if problem := chat_problem(len(prompt), run.job.sampling.max_new_tokens, run.context):
        return Outcome.failed(run.job_id, problem)
    return Asked(start, run.choices(prompt))


def answered(run: JobRun, asked: Asked | Outcome) -> Outcome:
    """What a chat job's requests gave: choice 0's text streams, and its outcome holds the others, with the timings
    of all of them as the job's."""
    if isinstance(asked, Outcome):
        return asked
    first, *others = completions = [future.result() for future in asked.choices]
    engine_ms = (time.monotonic() - asked.start) * 1e3
    first = replace(first, timings=merged_timings([completions], first))
    tools = tool_use(run.job)
    outcome = Outcome.answered(first, engine_ms, run.thinking, run.tokenizer, tools)
    outcome.choices = [Outcome.answered(c, engine_ms, run.thinking, run.tokenizer, tools) for c in others]
    return outcome


def reply(run: JobRun) -> Outcome:
    """A chat job: its requests (`ask`), then their answers (`answered`)."""
    return answered(run, ask(run))


# how each kind of job runs on the bridge
RUN_BY_KIND: dict[str, Callable[[JobRun], Outcome]] = {"chat": reply, "summarize": summarize}


@dataclass
class WorkerContext:
    """What one worker process holds for its whole life: the database, the engine, the reconciler."""

    settings: Settings
    celery: Celery
    sessions: sessionmaker[Session]
    router: Router  # where the jobs it sends again go (`broker.affinity`)
    bridge: Bridge
    reconciler: Reconciler
    name: str
    metrics: WorkerMetrics
    progress: ProgressPublisher
    leases: Leases  # the jobs this process holds, renewed at each heartbeat
    solo: Solo  # suspects run with the engine to themselves
    claim: GroupCommit[str, results.Claimed | None]  # job id -> the claimed job, or None: not queued
    store: GroupCommit[tuple[results.Claimed, Outcome], results.Stored]
    shutdown: Shutdown  # the grace of a warm shutdown, then its hand-back
    lines: ThreadPoolExecutor  # a grouped message's lines that are not single-answer chats run side by side here

    @classmethod
    def start(cls, settings: Settings, celery: Celery, name: str, advert: Advert,
              on_stall: Callable[[EngineStalled], None] | None = None) -> WorkerContext:
        """`name`: this worker's row in `workers` (`worker_name`), with its `advert`; `on_stall`: what to do when an
        engine thread stalls (an engine process is restarted instead). What was built is closed again if a later
        part fails: the engine process above all, which would keep this process from exiting."""
        with ExitStack() as built:
            # every write here retries on a dropped connection (`results.retrying`), so no ping per checkout
            db = make_db_engine(settings.database_url.get_secret_value(),
                                pool_size=min(settings.worker_concurrency, 32), ping_idle_s=None)
            built.callback(db.dispose)
            sessions = make_sessions(db)
            shutdown = Shutdown(settings.shutdown_grace_s)  # before the engine: its death in a shutdown is no crash
            bridge = Bridge.for_settings(start_engine(settings, on_death=partial(engine_died, shutdown=shutdown),
                                                      on_stall=on_stall), settings)
            built.callback(bridge.close)
            leases = Leases()
            router = Router(settings)
            metrics = WorkerMetrics.start(settings.worker_metrics_port, bridge.stats, settings.metrics_refresh_s)
            reconciler = Reconciler(sessions, celery, settings, name, leases, bridge.stop,
                                    lambda: (cpu_seconds(bridge.engine_pid), metrics.finished_total()),
                                    advert).start()  # its first beat reaches the database, or raises
            built.pop_all()
        shutdown.start(lambda reason: bridge.stop(bridge.running(), reason), partial(drain, settings, sessions, name))
        progress = ProgressPublisher(settings.broker_url.get_secret_value(), bridge.tokenizer)
        claim = GroupCommit(lambda ids: results.claim_many(sessions, ids, name, settings.max_attempts,
                                                           settings.dead_after_s), "claims")
        store = GroupCommit(lambda done: results.store_many(sessions, done, worker=name), "stores")
        # the bulk gate holds the lines in flight to its share of `worker_concurrency` (give or take a group)
        lines = ThreadPoolExecutor(settings.worker_concurrency, thread_name_prefix="line")
        return cls(settings, celery, sessions, router, bridge, reconciler, name, metrics, progress, leases, Solo(),
                   claim, store, shutdown, lines)

    def close(self) -> int:
        """Hand back the jobs this worker still holds, then close the engine and the rest; returns how many went
        back. The engine goes last: a task it outlived would see its end as a crash and exit the worker, leaving
        its job to expire and be charged."""
        self.shutdown.begin(cold=True)  # whatever still runs stops now, and an engine gone from here is no crash
        self.reconciler.stop()
        usage = self.reconciler.usage() if self.reconciler.usage is not None else None  # the jobs since its last beat
        try:
            return results.retrying(lambda: hand_back(self.sessions, self.name, usage), "hand back at shutdown",
                                    deadline_s=10.0)
        finally:  # a hand-back that failed is the sweep's to finish (leases); the rest closes all the same
            rehome_own(self.settings, self.name)
            self.bridge.close()
            self.lines.shutdown(wait=False)
            self.claim.close()
            self.store.close()
            self.progress.close()


def worker_name() -> str:
    """This process's row in `workers`: unique per process, and per start of a reused pid."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(time.time())}"


def drain(settings: Settings, sessions: sessionmaker[Session], name: str) -> None:
    """As this worker's shutdown begins: its row says it is draining, so the router sends it nothing more, and what
    already waits in its own queues goes to the shared ones now, not once the grace is spent."""
    try:
        mark_draining(sessions, name)
    finally:
        rehome_own(settings, name)


def rehome_own(settings: Settings, name: str) -> None:
    """At shutdown: what still waits in this worker's own queues goes to the shared ones, where the next worker
    takes it now rather than after the sweep has seen this worker gone."""
    broker = BrokerView(settings)
    try:
        if moved := broker.rehome(lambda _queue, tag: tag == home_tag(name)):
            log.info("moved %d messages from this worker's own queues to the shared queues", moved)
    except Exception:  # the broker is away: the sweep moves them once it sees this worker gone
        log.exception("could not move this worker's own queues' messages to the shared queues")
    finally:
        broker.close()


class Worker:
    """The context a worker process's task runs with, made once the worker starts."""

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
        """The preflight, before the worker consumes anything: the model is loaded here, in the process that runs
        it, and the database reached (the first heartbeat). If either fails the process exits `NOT_STARTED`: a
        receiver of `worker_init` that raises is only logged by Celery, which would then consume every message it
        can reach and fail each task for want of this context, acknowledging it: the queue drained into nothing."""
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
        """SIGQUIT: every run stops now and its job goes back (`worker.shutdown`), then the worker stops as at a
        warm shutdown, which hands back the rest and closes the engine (`stop`). Celery's own cold shutdown does
        neither: it waits out a soft shutdown in the signal handler, cannot cancel a thread's task, and ends without
        `worker_shutdown`, so the jobs waited for their leases and the exit for an engine process that ignores the
        signals meant for its worker."""
        with in_sighandler():
            if self.context is not None:
                self.context.shutdown.begin(cold=True)
            worker_state.should_stop = EX_OK

    def engine_stalled(self, error: EngineStalled) -> None:
        """An engine thread stalled (CONVOQ_ENGINE_PROCESS=false; a process is killed and restarted instead). A
        thread cannot be killed, so the jobs in the engine go back as a stall's (`results.stalled`), every other
        job this worker holds goes back uncharged, and the worker exits as at the engine's death. They are not
        sent again from here, where this worker would take them before it exits: the sweep sends them."""
        ctx = self.context
        try:
            running = set(ctx.bridge.running())
            results.stalled(ctx.sessions, [c for c in ctx.leases.claims() if str(c.job_id) in running],
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
        if ctx.shutdown.begun.is_set():  # delivered but not started: the next worker takes it now, not after us
            raise Reject(f"jobs {', '.join(job_ids)} not started: the worker is shutting down", requeue=True)
        claims = []
        for job_id, future in zip(job_ids, ctx.claim.many(job_ids), strict=True):
            try:
                claimed = future.result()
            except Exception:  # this line alone: its row stays queued, and the sweep sends it again
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


def run_claims(ctx: WorkerContext, claims: list[results.Claimed]) -> None:
    """Run the jobs of a message, which this worker holds the leases of, and store their outcomes in one write.
    A suspect (in `suspect_after_crashes` crashes) runs with the engine to itself, after the others, and says so in
    its row first; it keeps the engine to itself until its outcome is written, so that a crash after it cannot be
    blamed on it. A job handed back at shutdown returns the message to the queue once every job of it is through
    (the message's other jobs, finished, are dropped at their next claim)."""
    suspect = ctx.settings.suspect_after_crashes
    together = [c for c in claims if c.crashes < suspect]
    handed_back = False
    if together:
        with ctx.solo.shared():
            handed_back |= run_together(ctx, together, alone=False)
    for claimed in claims:
        if claimed.crashes >= suspect:
            with ctx.solo.alone():
                handed_back |= run_together(ctx, [claimed], alone=True)
    if handed_back:
        raise Reject(f"jobs {', '.join(str(c.job_id) for c in claims)} handed back: the worker is shutting down",
                     requeue=True)


def run_together(ctx: WorkerContext, claims: list[results.Claimed], alone: bool) -> bool:
    """Run `claims` side by side (a single job on this thread), then store the outcomes of those that finished in
    one write; True if one of them was handed back at shutdown."""
    if len(claims) == 1:
        ran = [execute(ctx, claims[0], alone)]
    elif all(two_phase(c.job) for c in claims):
        ran = run_chats(ctx, claims)
    else:
        ran = list(ctx.lines.map(lambda c: execute(ctx, c, alone), claims))
    done = [(c, outcome) for c, outcome in zip(claims, ran, strict=True) if isinstance(outcome, Outcome)]
    for (claimed, outcome), future in zip(done, ctx.store.many(done), strict=True):
        try:
            stored = future.result()
        except Exception as exc:  # this line's write alone: the others' went through without it
            run_failed(ctx, claimed, exc)
            continue
        if not stored.applied:
            ctx.metrics.refused()
            continue
        ctx.progress.status(str(claimed.job_id), stored.status)
        ctx.metrics.observe(claimed.job.priority, stored, outcome.completion_tokens)
    return any(outcome is True for outcome in ran)


def two_phase(job: JobIn) -> bool:
    """A job whose run is one round through the engine: a chat with a single answer (`run_chats`). A chat's
    further choices wait for the first's prompt to be computed, and a summary's levels for the level before."""
    return job.kind == "chat" and job.n == 1


@dataclass
class Asking:
    """A job of `run_chats` between its two phases."""

    run: JobRun
    asked: Asked | Outcome
    stack: ExitStack  # leaves the job's run on the bridge, as leaving `execute`'s `with` does


def run_chats(ctx: WorkerContext, claims: list[results.Claimed]) -> list[Outcome | bool]:
    """Single-answer chats of one message, on this thread in two phases: every job's request goes into the engine,
    which batches them as it would a thread's each, then each job's answer is awaited in turn. A thread per job
    would cost each job its wake-ups and its hand-offs of the interpreter lock for nothing: the jobs wait on the
    engine, not on each other. Each job is settled on its own, as `execute` settles it."""
    def begin(claimed: results.Claimed) -> Asking:
        ctx.progress.status(str(claimed.job_id), JobStatus.running)
        with ExitStack() as stack:  # asking failed: the run is left here, before its failure is settled
            run = stack.enter_context(opened(ctx, claimed))
            asked = ask(run)
            return Asking(run, asked, stack.pop_all())

    def finish(claimed: results.Claimed, asking: Asking) -> Outcome | bool:
        with asking.stack:
            outcome = answered(asking.run, asking.asked)
        return judged(ctx, claimed, outcome)

    asked = [guarded(ctx, c, partial(begin, c)) for c in claims]
    return [guarded(ctx, c, partial(finish, c, a)) if isinstance(a, Asking) else a
            for c, a in zip(claims, asked, strict=True)]


def execute(ctx: WorkerContext, claimed: results.Claimed, alone: bool) -> Outcome | bool:
    """Run one claimed job through the engine: its outcome, to store; or, once it was settled here otherwise,
    True if it was handed back at shutdown (its message must go back to the queue), else False."""
    def run() -> Outcome | bool:
        if alone and not results.mark_alone(ctx.sessions, claimed):
            ctx.metrics.refused()
            return False
        with opened(ctx, claimed) as job_run:
            outcome = RUN_BY_KIND[claimed.job.kind](job_run)
        return judged(ctx, claimed, outcome)

    ctx.progress.status(str(claimed.job_id), JobStatus.running)
    return guarded(ctx, claimed, run)


@contextmanager
def opened(ctx: WorkerContext, claimed: results.Claimed) -> Iterator[JobRun]:
    """The job's run on the bridge, its tokens streaming to the job's progress events."""
    job_id = str(claimed.job_id)
    with ctx.bridge.run(job_id, claimed.job, claimed.created_at, claimed.deadline_at,
                        on_tokens=lambda ids: ctx.progress.tokens(job_id, ids, claimed.lease),
                        tenant=claimed.tenant) as run:
        if ctx.shutdown.over.is_set():  # the grace ended as this run came in, after the runs were stopped
            run.stop(FinishReason.shutdown)
        yield run


def judged(ctx: WorkerContext, claimed: results.Claimed, outcome: Outcome) -> Outcome | bool:
    """What a finished run leaves to do: its outcome, to store; or, for a run that must not store it (stopped at
    shutdown, or its lease lost), the job settled here (`execute`'s answer). A failure the engine may not fail
    again raises, for `guarded` to retry the job."""
    verdict = outcome.verdict
    if verdict.finish_reason == FinishReason.shutdown:
        return hand_back_at_shutdown(ctx, claimed)
    if verdict.finish_reason == FinishReason.lease_lost:  # what it did is not this run's to write
        if not results.give_back(ctx.sessions, claimed):
            ctx.metrics.refused()
        return False
    if verdict.retryable:
        raise RuntimeError(verdict.error)
    return outcome


def guarded(ctx: WorkerContext, claimed: results.Claimed, step: Callable[[], T]) -> T | bool:
    """`step` of a job's run, the job settled here if it raises: a stalled engine hands it back as a stall's, a
    dead one ends the worker (at shutdown, the job goes back uncharged: True), anything else is retried or fails
    the job (False). Should settling fail too (the database away for long), this job alone, not its group, is
    left to its lease: False."""
    try:
        try:
            return step()
        except EngineStalled:  # the engine was killed and is being restarted: the job goes back, as a stall's
            hand_back_stalled(ctx, claimed)
        except EngineDead as exc:
            if not ctx.shutdown.begun.is_set():
                engine_died(exc)
            return hand_back_at_shutdown(ctx, claimed)  # closed under it at shutdown: no crash of this job's doing
        except Exception as exc:
            run_failed(ctx, claimed, exc)
    except Exception:
        log.exception("job %s could not be settled; its lease expires and the sweep hands it back", claimed.job_id)
    return False


def run_failed(ctx: WorkerContext, claimed: results.Claimed, exc: Exception) -> None:
    """What raised goes to this log and to the job's `error_detail`, which only admin keys read: its text may hold
    SQL, a path or a host name. The job's tenant is told the stable message of its code."""
    log.exception("job %s failed (attempt %d of %d)", claimed.job_id, claimed.attempt, ctx.settings.max_attempts)
    retry_or_fail(ctx, claimed, f"{type(exc).__name__}: {exc}")


def engine_died(error: EngineDead, shutdown: Shutdown | None = None) -> None:
    """The model's state is unknown: exit so the supervisor restarts the worker; this worker's leases then
    expire and the reconciler hands its jobs back. During a shutdown the worker is leaving anyway: its tasks
    hand their jobs back uncharged (`hand_back_at_shutdown`) and it exits as it was going to."""
    if shutdown is not None and shutdown.begun.is_set():
        log.warning("the engine ended during shutdown (%s); its jobs go back to the queue", error)
        return
    log.critical("the engine is dead (%s); exiting", error)
    os._exit(3)


def hand_back_at_shutdown(ctx: WorkerContext, claimed: results.Claimed) -> bool:
    """A run its worker's shutdown ended: the job goes back uncharged; True: its message must go back to the queue,
    where the next worker takes it (`worker.shutdown`). A job that moved on meanwhile needs neither: its message
    is acked."""
    ctx.leases.drop(claimed)  # first: the heartbeat must not take a job on its way back for a lost one
    if not results.give_back(ctx.sessions, claimed, requeued=True):
        ctx.metrics.refused()
        return False
    ctx.progress.status(str(claimed.job_id), JobStatus.queued)
    return True


def hand_back_stalled(ctx: WorkerContext, claimed: results.Claimed) -> None:
    """A job whose engine stalled with it inside goes back to the queue and is sent again at once
    (`results.stalled` decides whether it is charged a crash)."""
    ctx.leases.drop(claimed)  # first: the heartbeat must not take a job on its way back for a lost one
    status = results.stalled(ctx.sessions, [claimed], ctx.settings.max_crashes, sends=True).get(claimed.job_id)
    if status is None:
        ctx.metrics.refused()
        return
    ctx.progress.status(str(claimed.job_id), status)
    if status == JobStatus.queued:
        with ctx.sessions() as session:
            # to the shared queue: this worker's engine is reloading, with an empty prefix cache
            publish(ctx.celery, session, [session.get(Job, claimed.job_id)], ctx.settings, stamped=True)


def retry_or_fail(ctx: WorkerContext, claimed: results.Claimed, error: str) -> None:
    """Try again later with exponential backoff while attempts remain; then the job fails as the engine's error,
    `error` its detail."""
    s = ctx.settings
    if claimed.attempt >= s.max_attempts:
        if not results.fail(ctx.sessions, claimed, ErrorCode.engine_error,
                            f"failed after {claimed.attempt} attempts: {error}"):
            ctx.metrics.refused()
            return
        ctx.progress.status(str(claimed.job_id), JobStatus.failed)
        ctx.metrics.gave_up()
        return
    if not results.requeue(ctx.sessions, claimed, error):
        ctx.metrics.refused()
        return
    ctx.progress.status(str(claimed.job_id), JobStatus.queued)
    ctx.metrics.retried()
    with ctx.sessions() as session:
        job = session.get(Job, claimed.job_id)
        publish(ctx.celery, session, [job], s, countdown=s.retry_backoff_s * 2 ** (claimed.attempt - 1),
                stamped=True, router=ctx.router)
