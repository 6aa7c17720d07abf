"""Settling a job whose run ended without an outcome to store: retried or failed after an error, handed back
at shutdown, or handed back because its engine stalled.
"""

from __future__ import annotations

import logging

from broker.publish import publish
from jobs.error_codes import ErrorCode
from jobs.status import JobStatus
from jobs.tables import Job
from worker.context import WorkerContext
from worker.fence import Claimed
from worker.outcome import Ending, RunEnd
from worker.run_ends import fail, give_back, record_stall, requeue

log = logging.getLogger(__name__)


def run_failed(ctx: WorkerContext, claimed: Claimed, exc: Exception) -> None:
    """What raised goes to this log and to the job's `error_detail`, which only admin keys read: its text may hold
    SQL, a path or a host name. The job's tenant is told the stable message of its code."""
    log.exception("job %s failed (attempt %d of %d)", claimed.job_id, claimed.attempt, ctx.settings.max_attempts)
    retry_or_fail(ctx, claimed, f"{type(exc).__name__}: {exc}")


def hand_back_at_shutdown(ctx: WorkerContext, claimed: Claimed) -> RunEnd:
    """A run that its worker's shutdown ended. The job goes back uncharged, and its message goes back to the
    queue, where the next worker takes it (`worker.shutdown`). A job that moved on meanwhile needs neither, and
    its message is acked."""
    ctx.leases.drop(claimed)  # first, so that the heartbeat does not take a job on its way back for a lost one
    if not give_back(ctx.sessions, claimed, requeued=True):
        ctx.metrics.refused()
        return RunEnd(Ending.SETTLED)
    ctx.progress.status(str(claimed.job_id), JobStatus.queued)
    return RunEnd(Ending.HANDED_BACK)


def hand_back_stalled(ctx: WorkerContext, claimed: Claimed) -> None:
    """A job whose engine stalled with it inside goes back to the queue and is sent again at once
    (`run_ends.record_stall` decides whether it is charged a crash)."""
    ctx.leases.drop(claimed)  # first, so that the heartbeat does not take a job on its way back for a lost one
    status = record_stall(ctx.sessions, [claimed], ctx.settings.max_crashes, sends=True).get(claimed.job_id)
    if status is None:
        ctx.metrics.refused()
        return
    ctx.progress.status(str(claimed.job_id), status)
    if status == JobStatus.queued:
        with ctx.sessions() as session:
            # to the shared queue, because this worker's engine is reloading with an empty prefix cache
            publish(ctx.celery, session, [session.get(Job, claimed.job_id)], ctx.settings, stamped=True)


def retry_or_fail(ctx: WorkerContext, claimed: Claimed, error: str) -> None:
    """Try again later with exponential backoff while attempts remain; then the job fails as the engine's error,
    `error` its detail."""
    s = ctx.settings
    if claimed.attempt >= s.max_attempts:
        if not fail(ctx.sessions, claimed, ErrorCode.engine_error,
                            f"failed after {claimed.attempt} attempts: {error}"):
            ctx.metrics.refused()
            return
        ctx.progress.status(str(claimed.job_id), JobStatus.failed)
        ctx.metrics.gave_up()
        return
    if not requeue(ctx.sessions, claimed, error):
        ctx.metrics.refused()
        return
    ctx.progress.status(str(claimed.job_id), JobStatus.queued)
    ctx.metrics.retried()
    with ctx.sessions() as session:
        job = session.get(Job, claimed.job_id)
        publish(ctx.celery, session, [job], s, countdown=s.retry_backoff_s * 2 ** (claimed.attempt - 1),
                stamped=True, router=ctx.router)
