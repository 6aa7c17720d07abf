"""Retention: what has been finished for longer than a cut-off is deleted, a bounded chunk per transaction.

- A job that ended (`succeeded`, `failed`, `cancelled`, `expired`) before the cut-off goes with its result
  and timings rows; an item of a batch goes only with its batch, so an open batch never loses items.
- A batch goes once it is settled (`completed`, `failed`, `cancelled`, `expired`) since before the cut-off and
  none of its items is still queued or running; its items go first, in chunks, then the batch rows.
- A `workers` row goes once it has not beaten for as long as the cut-off and no running job names it: a
  job's `worker` names a row for as long as the job itself is kept.

Each chunk (`chunk` ids, listed once, so no statement carries more bind parameters than that) is its own
transaction: a prune of millions of jobs never holds a long lock, and one stopped halfway has deleted whole
chunks only. The cut-off is taken from this process's clock: at a scale of days, clock skew between hosts
does not matter. Several prunes at once are harmless (a row already deleted is simply not deleted again);
the reconciler runs one under its lock when `CONVOQ_RETENTION_DAYS` is set, `convoq prune` runs one by hand.
Files (`/v1/files`) are kept until their owner deletes them, as OpenAI's are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Select, and_, delete, exists, func, select
from sqlalchemy.orm import Session, aliased, sessionmaker

from jobs.settings import Settings
from jobs.status import BATCH_SETTLED, TERMINAL, JobStatus
from jobs.tables import Batch, Job, Result, Timing, Worker, utcnow
from store.counts import fold

FINISHED = sorted(s.value for s in TERMINAL)
SETTLED = sorted(s.value for s in BATCH_SETTLED)


@dataclass
class PruneReport:
    """Rows deleted (or, in a dry run, that would be) older than `cutoff`."""

    cutoff: datetime
    dry_run: bool
    jobs: int = 0
    results: int = 0
    timings: int = 0
    batches: int = 0
    workers: int = 0

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        return (f"{verb} {self.jobs} jobs ({self.results} results, {self.timings} timings), {self.batches} "
                f"batches and {self.workers} workers rows finished before {self.cutoff.isoformat(timespec='seconds')}")


def retention_period(settings: Settings) -> timedelta | None:
    """How long finished work is kept; None: forever."""
    return timedelta(days=settings.retention_days) if settings.retention_days > 0 else None


def _old_batches(cutoff: datetime) -> ColumnElement[bool]:
    settled_at = func.coalesce(Batch.completed_at, Batch.cancelled_at, Batch.failed_at, Batch.expired_at,
                               Batch.created_at)
    item = aliased(Job)  # not the jobs of an enclosing query: this one looks at the batch's own items
    unfinished = exists().where(item.batch_id == Batch.id, item.status.not_in(FINISHED)).correlate(Batch)
    return and_(Batch.status.in_(SETTLED), Batch.created_at < cutoff, settled_at < cutoff, ~unfinished)


def _old_jobs(cutoff: datetime) -> list[Select]:
    """Jobs of no batch finished before the cut-off (read off `ix_jobs_finished`), and the items of old settled
    batches: two queries, as one with an OR between them would use neither index."""
    return [
        select(Job.id).where(Job.finished_at < cutoff, Job.batch_id.is_(None), Job.status.in_(FINISHED)),
        select(Job.id).where(Job.batch_id.in_(select(Batch.id).where(_old_batches(cutoff))),
                             Job.status.in_(FINISHED)),
    ]


def _dead_workers(cutoff: datetime) -> Select:
    running = exists().where(Job.worker == Worker.name, Job.status == JobStatus.running.value)
    return select(Worker.name).where(Worker.heartbeat_at < cutoff, ~running)


def _count(session: Session, rows: Select) -> int:
    return session.scalar(select(func.count()).select_from(rows.subquery()))


def prune(sessions: sessionmaker[Session], older_than: timedelta, chunk: int = 1000, dry_run: bool = False,
          progress: Callable[[int], object] | None = None,
          before_chunk: Callable[[], object] | None = None) -> PruneReport:
    """Delete what finished more than `older_than` ago (see the module's docstring); with `dry_run`, only count
    it. `progress` hears how many jobs each chunk deleted; `before_chunk` is called before each chunk (the
    reconciler checks there that it still holds its lock, and stops by raising)."""
    if older_than < timedelta(0) or chunk < 1:
        raise ValueError("older_than must not be negative and chunk must be positive")
    report = PruneReport(utcnow() - older_than, dry_run)
    old_jobs = _old_jobs(report.cutoff)
    old_batches = select(Batch.id).where(_old_batches(report.cutoff))
    dead_workers = _dead_workers(report.cutoff)
    if dry_run:
        with sessions() as session:
            for rows in old_jobs:
                report.jobs += _count(session, rows)
                report.results += _count(session, select(Result.job_id).where(Result.job_id.in_(rows)))
                report.timings += _count(session, select(Timing.job_id).where(Timing.job_id.in_(rows)))
            report.batches = _count(session, old_batches)
            report.workers = _count(session, dead_workers)
        return report

    jobs, results, timings = Job.__table__, Result.__table__, Timing.__table__
    for rows in old_jobs:
        while ids := _chunk(sessions, rows, chunk, before_chunk):
            with sessions.begin() as session:
                # results and timings would go by cascade too; deleting them here counts them
                report.results += session.execute(delete(results).where(results.c.job_id.in_(ids))).rowcount
                report.timings += session.execute(delete(timings).where(timings.c.job_id.in_(ids))).rowcount
                deleted = session.execute(delete(jobs).where(jobs.c.id.in_(ids))).rowcount
            report.jobs += deleted
            if progress is not None:
                progress(deleted)
    batches, workers = Batch.__table__, Worker.__table__
    while ids := _chunk(sessions, old_batches, chunk, before_chunk):
        with sessions.begin() as session:
            report.batches += session.execute(delete(batches).where(batches.c.id.in_(ids))).rowcount
    while names := _chunk(sessions, dead_workers, chunk, before_chunk):
        with sessions.begin() as session:
            report.workers += session.execute(delete(workers).where(workers.c.name.in_(names))).rowcount
    with sessions.begin() as session:
        fold(session)  # each chunk appended its deltas to the status counts
    return report


def _chunk(sessions: sessionmaker[Session], rows: Select, chunk: int, before: Callable[[], object] | None) -> list:
    if before is not None:
        before()
    with sessions() as session:
        return list(session.scalars(rows.limit(chunk)))
