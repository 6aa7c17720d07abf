"""Running the claimed jobs of a message. They run side by side, by their kind, through the engine, and the
outcomes of those that finished are stored in one write. Each job is settled on its own, so one that fails fails
alone. A run ends as a `RunEnd`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from celery.exceptions import Reject

from engine.interface import EngineDead, EngineStalled, FinishReason
from jobs.schemas import JobIn
from jobs.status import JobStatus
from worker.bridge import JobRun
from worker.claims import mark_alone
from worker.context import WorkerContext, engine_died
from worker.fence import Claimed
from worker.outcome import Ending, Outcome, RunEnd
from worker.reply import Asked, answered, ask, reply
from worker.run_ends import give_back
from worker.settling import hand_back_at_shutdown, hand_back_stalled, run_failed
from worker.summarize import summarize

log = logging.getLogger(__name__)
T = TypeVar("T")


# how each kind of job runs on the bridge
RUN_BY_KIND: dict[str, Callable[[JobRun], Outcome]] = {"chat": reply, "summarize": summarize}


def run_claims(ctx: WorkerContext, claims: list[Claimed]) -> None:
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


def run_together(ctx: WorkerContext, claims: list[Claimed], alone: bool) -> bool:
    """Run `claims` side by side (a single job on this thread), then store the outcomes of those that finished in
    one write; True if one of them was handed back at shutdown."""
    if len(claims) == 1:
        ran = [execute(ctx, claims[0], alone)]
    elif all(two_phase(c.job) for c in claims):
        ran = run_chats(ctx, claims)
    else:
        ran = list(ctx.lines.map(lambda c: execute(ctx, c, alone), claims))
    done = [(c, end.outcome) for c, end in zip(claims, ran, strict=True) if end.outcome is not None]
    for (claimed, outcome), future in zip(done, ctx.store.many(done), strict=True):
        try:
            stored = future.result()
        except Exception as exc:  # this line's write alone failed, and the others' went through without it
            run_failed(ctx, claimed, exc)
            continue
        if not stored.applied:
            ctx.metrics.refused()
            continue
        ctx.progress.status(str(claimed.job_id), stored.status)
        ctx.metrics.observe(claimed.job.priority, stored, outcome.completion_tokens)
    return any(end.ending is Ending.HANDED_BACK for end in ran)


def two_phase(job: JobIn) -> bool:
    """Whether a job's run is one round through the engine, as a chat with a single answer is (`run_chats`). A
    chat's further choices wait for the first's prompt to be computed, and a summary's levels for the level
    before."""
    return job.kind == "chat" and job.n == 1


@dataclass
class Asking:
    """A job of `run_chats` between its two phases."""

    run: JobRun
    asked: Asked | Outcome
    stack: ExitStack  # leaves the job's run on the bridge, as leaving `execute`'s `with` does


def run_chats(ctx: WorkerContext, claims: list[Claimed]) -> list[RunEnd]:
    """Single-answer chats of one message, on this thread in two phases. Every job's request goes into the
    engine, which batches them as it would a thread's each, then each job's answer is awaited in turn. A thread
    per job would cost each job its wake-ups and its hand-offs of the interpreter lock for nothing, since the
    jobs wait on the engine, not on each other. Each job is settled on its own, as `execute` settles it."""
    def begin(claimed: Claimed) -> Asking:
        ctx.progress.status(str(claimed.job_id), JobStatus.running)
        with ExitStack() as stack:  # if asking fails, the run is left here, before its failure is settled
            run = stack.enter_context(opened(ctx, claimed))
            asked = ask(run)
            return Asking(run, asked, stack.pop_all())

    def finish(claimed: Claimed, asking: Asking) -> RunEnd:
        with asking.stack:
            outcome = answered(asking.run, asking.asked)
        return judged(ctx, claimed, outcome)

    asked = [guarded(ctx, c, partial(begin, c)) for c in claims]
    return [guarded(ctx, c, partial(finish, c, a)) if isinstance(a, Asking) else a
            for c, a in zip(claims, asked, strict=True)]


def execute(ctx: WorkerContext, claimed: Claimed, alone: bool) -> RunEnd:
    """Run one claimed job through the engine. It finishes with an outcome to store, or it was settled here in
    some other way (`judged`, `guarded`)."""
    def run() -> RunEnd:
        if alone and not mark_alone(ctx.sessions, claimed):
            ctx.metrics.refused()
            return RunEnd(Ending.SETTLED)
        with opened(ctx, claimed) as job_run:
            outcome = RUN_BY_KIND[claimed.job.kind](job_run)
        return judged(ctx, claimed, outcome)

    ctx.progress.status(str(claimed.job_id), JobStatus.running)
    return guarded(ctx, claimed, run)


@contextmanager
def opened(ctx: WorkerContext, claimed: Claimed) -> Iterator[JobRun]:
    """The job's run on the bridge, its tokens streaming to the job's progress events."""
    job_id = str(claimed.job_id)
    with ctx.bridge.run(job_id, claimed.job, claimed.created_at, claimed.deadline_at,
                        on_tokens=lambda ids: ctx.progress.tokens(job_id, ids, claimed.lease),
                        tenant=claimed.tenant) as run:
        if ctx.shutdown.over.is_set():  # the grace ended as this run came in, after the runs were stopped
            run.stop(FinishReason.shutdown)
        yield run


def judged(ctx: WorkerContext, claimed: Claimed, outcome: Outcome) -> RunEnd:
    """How a run whose engine work is over ends. Usually its outcome is stored. A run stopped at shutdown, or
    one whose lease was lost, must not store it, so its job is settled here instead. A failure that the engine
    may not repeat raises, and `guarded` retries the job."""
    verdict = outcome.verdict
    if verdict.finish_reason == FinishReason.shutdown:
        return hand_back_at_shutdown(ctx, claimed)
    if verdict.finish_reason == FinishReason.lease_lost:  # what it did is not this run's to write
        if not give_back(ctx.sessions, claimed):
            ctx.metrics.refused()
        return RunEnd(Ending.SETTLED)
    if verdict.retryable:
        raise RuntimeError(verdict.error)
    return RunEnd.finished(outcome)


def guarded(ctx: WorkerContext, claimed: Claimed, step: Callable[[], T]) -> T | RunEnd:
    """Run `step` of a job's run, and settle the job here if it raises.

    If the engine stalled, the job goes back as a stall's. If the engine died, the worker exits, unless it is
    shutting down, in which case the job goes back uncharged. Anything else retries the job or fails it. If
    settling fails too (the database is away for long), this job alone is left to its lease, not its group.
    """
    try:
        try:
            return step()
        except EngineStalled:  # the engine was killed and is being restarted, so the job goes back as a stall's
            hand_back_stalled(ctx, claimed)
        except EngineDead as exc:
            if not ctx.shutdown.begun.is_set():
                engine_died(exc)
            # the engine was closed under the job at shutdown, so the job caused no crash
            return hand_back_at_shutdown(ctx, claimed)
        except Exception as exc:
            run_failed(ctx, claimed, exc)
    except Exception:
        log.exception("job %s could not be settled; its lease expires and the sweep hands it back", claimed.job_id)
    return RunEnd(Ending.SETTLED)
