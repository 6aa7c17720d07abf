"""How a run ends when it has no outcome to store. Its job fails, goes back to the queue for a retry, is handed
back uncharged by its live worker, or is handed back because its engine stalled. Also the statements the sweep
uses to end a run whose worker can no longer finish it."""

from __future__ import annotations

import uuid

from sqlalchemy import ColumnElement, Update, bindparam, select, tuple_, update
from sqlalchemy.orm import Session, sessionmaker

from jobs.error_codes import ERROR_MESSAGES, ErrorCode, error_columns
from jobs.status import JobStatus
from jobs.tables import Job, Run, utcnow
from store.clock import db_now
from worker.database import retrying, settle, storable
from worker.fence import FAILED, QUEUED, RUNNING, Claimed, end_runs, ended_row, fenced_write, holds, refuse


def returned_columns(crashes: ColumnElement[int] | int = 0) -> dict:
    """The columns of a running job sent back to `queued` because its run ended with its worker: not an attempt
    (the claim's is refunded), `crashes` more crashes."""
    jobs = Job.__table__
    return dict(status=QUEUED, worker=None, published_at=None, lease_expires_at=None, alone_at=None,
                attempts=jobs.c.attempts - 1, crashes=jobs.c.crashes + crashes)


def failure_columns(code: ErrorCode, detail: str) -> dict[str, str | None]:
    """The error columns of a job that `detail` (what raised, for operators) made fail with `code`."""
    return error_columns(code, detail=storable(detail)[:4000])


def sent_now_columns() -> dict:
    """The columns of a job going back to `queued` whose writer sends its message itself, either at once (a
    retry's, a stall's) or by returning it to the queue (a shutdown's). The job counts as published from this
    moment. So a sweep judges it from when it went back, not from its creation, and sends a second message only
    once that one is missing. The writer's `publish(..., stamped=True)` takes the stamp back if its message does
    not go out."""
    return dict(published_at=db_now(), message_missing_at=None)


def fail(sessions: sessionmaker[Session], claimed: Claimed, code: ErrorCode, detail: str) -> bool:
    """A job whose run raised: it ends `failed` with `code` instead of staying `running` forever, what raised
    kept as its `error_detail`. False if the run no longer holds the job (the write was refused)."""
    values = dict(status=FAILED, finished_at=utcnow(), lease_expires_at=None, **failure_columns(code, detail))
    applied = fenced_write(sessions, claimed, values, FAILED, "failure", ended_row("failed"))
    if applied and claimed.batch_id is not None:
        retrying(lambda: settle(sessions, claimed.batch_id), f"settle batch {claimed.batch_id}")
    return applied


def requeue(sessions: sessionmaker[Session], claimed: Claimed, detail: str) -> bool:
    """Put a job whose attempt raised (`detail`: what raised) back to `queued` (for a delayed retry); False if this
    run no longer holds it. The lease stays on the row only so that a retry of this write recognises it; a claim
    replaces it."""
    values = dict(status=QUEUED, worker=None, lease_expires_at=None, **sent_now_columns(),
                  **failure_columns(ErrorCode.engine_error, detail))
    return fenced_write(sessions, claimed, values, QUEUED, "retry", ended_row("retry"))


def give_back(sessions: sessionmaker[Session], claimed: Claimed, requeued: bool = False) -> bool:
    """A run that its live worker ends without an outcome, because it lost the job's lease or is shutting
    down. The job goes back to `queued` uncharged, neither an attempt nor a crash (its worker did not die). If it
    moved on meanwhile, the write is refused. With `requeued`, the caller returns the job's message to the queue,
    so the row says it is published and a sweep sends no second one."""
    values = returned_columns() | (sent_now_columns() if requeued else {})
    return fenced_write(sessions, claimed, values, QUEUED, "hand-back", ended_row("returned"))


def lost_run_updates(keep_lease: bool = False, code: ErrorCode = ErrorCode.crashed) -> tuple[Update, Update]:
    """The fenced statements that end a run its worker can no longer finish, because its lease expired or its
    engine stalled. Their parameters are `j` (the job id) and `l` (the run's lease). The first sends the job back
    to `queued`, charged `charge` crashes. The second fails it with `code`, a crash past the last one, with `e`
    as its detail. With `keep_lease`, the lease stays on the row, so that the writer, retrying after a lost
    reply, recognises its own hand-back (a stall's, from the worker that holds the run)."""
    jobs = Job.__table__
    fenced = holds(bindparam("j"), bindparam("l"))
    lease = {} if keep_lease else {"lease_id": None}
    back = update(jobs).where(fenced).values(**returned_columns(crashes=bindparam("charge")), **lease)
    failed = update(jobs).where(fenced).values(
        status=FAILED, error=ERROR_MESSAGES[code], error_code=code.value, error_detail=bindparam("e"),
        finished_at=db_now(), lease_expires_at=None, crashes=jobs.c.crashes + 1, **lease)
    return back, failed


STALLED = "stalled"  # how a run ends when its engine stalled with it inside and was killed


def record_stall(sessions: sessionmaker[Session], claims: list[Claimed], max_crashes: int,
                 sends: bool = False) -> dict[uuid.UUID, JobStatus]:
    """Record that these jobs' engine stalled with them in it. They go back to `queued`, neither an attempt
    (the claim's is refunded) nor a crash, because one stall says nothing about which request caused it. A job
    whose earlier run stalled too is charged a crash (the suspect rules follow from there), and fails if that
    makes `max_crashes`. A job that ran alone (a suspect, `mark_alone`) is condemned, as a worker's death while it
    runs alone condemns it. Nothing else was in the engine, so it fails, charged the crash, instead of stalling
    engines until its crashes run out. Each run ends `stalled`. Returns the status each job was left in. The runs
    that no longer hold their job are refused and left out. With `sends`, the caller sends the jobs left queued
    again itself (`sent_now_columns`); otherwise a sweep does."""
    jobs, runs = Job.__table__, Run.__table__
    pairs = [(c.job_id, c.lease) for c in claims]
    back, failed = lost_run_updates(keep_lease=True, code=ErrorCode.timeout)
    back = back.values(**sent_now_columns()) if sends else back

    def action() -> tuple[dict[uuid.UUID, JobStatus], set[uuid.UUID]]:
        with sessions.begin() as session:
            rows = session.execute(select(jobs.c.id, jobs.c.lease_id, jobs.c.status, jobs.c.crashes, jobs.c.batch_id,
                                          jobs.c.alone_at)
                                   .where(tuple_(jobs.c.id, jobs.c.lease_id).in_(pairs)).with_for_update()).all()
            ours = dict(session.execute(select(runs.c.job_id, runs.c.outcome)
                                        .where(tuple_(runs.c.job_id, runs.c.lease_id).in_(pairs))).all())
            earlier = set(session.scalars(select(runs.c.job_id).where(
                runs.c.job_id.in_([row.id for row in rows]), runs.c.outcome == STALLED,
                tuple_(runs.c.job_id, runs.c.lease_id).not_in(pairs))))
            left: dict[uuid.UUID, JobStatus] = {}
            back_rows, fail_rows, batches = [], [], set()
            for row in rows:
                if row.status != RUNNING:  # this write, tried before (its reply was lost), or refused below
                    if ours.get(row.id) == STALLED:
                        left[row.id] = JobStatus(row.status)
                        batches.add(row.batch_id if row.status == FAILED else None)
                    continue
                charge = int(row.id in earlier)
                if row.alone_at is not None or (charge and row.crashes + 1 >= max_crashes):
                    why = ("while it ran alone: it is taken to be the cause" if row.alone_at is not None
                           else "with it running in two runs or more (CONVOQ_MAX_CRASHES)")
                    fail_rows.append(dict(j=row.id, l=row.lease_id,
                                          e=f"its engine stalled {why}; {row.crashes + 1} crashes"))
                    left[row.id] = JobStatus.failed
                    batches.add(row.batch_id)
                else:
                    back_rows.append(dict(j=row.id, l=row.lease_id, charge=charge))
                    left[row.id] = JobStatus.queued
            if back_rows:
                session.connection().execute(back, back_rows)
            if fail_rows:
                session.connection().execute(failed, fail_rows)
            end_runs(session, [(r["j"], r["l"], STALLED) for r in back_rows + fail_rows])
            refuse(session, [c for c in claims if c.job_id not in left], "stall hand-back")
        return left, batches - {None}

    left, batches = retrying(action, f"hand back {len(claims)} jobs of a stalled engine")
    for batch_id in batches:
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    return left
