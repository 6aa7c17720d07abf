"""Claiming queued jobs under a new lease, in one statement however many, and marking a claimed run as
running alone."""

from __future__ import annotations

import functools
import uuid

from pydantic import ValidationError
from sqlalchemy import ColumnElement, Executable, Row, any_, bindparam, case, or_, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from jobs.error_codes import ERROR_MESSAGES, ErrorCode
from jobs.schemas import JobIn
from jobs.status import JobStatus
from jobs.tables import Job, Run, utcnow
from store.clock import db_now
from store.writes import insert_ignore
from worker.database import committing, retrying, settle
from worker.fence import JOBS, QUEUED, RUNNING, RUNS, Claimed, fenced_write
from worker.run_ends import fail


def claim(sessions: sessionmaker[Session], job_id: str, worker: str, max_attempts: int,
          lease_s: float = 30.0) -> Claimed | None:
    """Take a queued job under a new lease; None if it is not queued (a duplicate message, or already taken)."""
    return claim_many(sessions, [job_id], worker, max_attempts, lease_s)[0]


def claim_many(sessions: sessionmaker[Session], job_ids: list[str], worker: str, max_attempts: int,
               lease_s: float = 30.0) -> list[Claimed | None]:
    """`claim` for many jobs in one statement; an id listed twice is claimed once, by its first entry.

    Each claimed job gets this call's lease, expiring `lease_s` from now on the database's clock unless renewed,
    and a `runs` row. Retried after a lost reply, the statement also matches the jobs it took the first time (they
    run under its lease), so a commit that succeeded is never mistaken for someone else's claim.
    A job that has used up its attempts, or whose payload is not a valid job, is failed here instead of run;
    one cancelled or past its deadline ends without running (`end_unrun`).
    """
    ids = {uuid.UUID(i) for i in job_ids}
    lease = uuid.uuid4()
    params = dict(claim_ids=list(ids), claim_lease=lease, claim_worker=worker, claim_now=utcnow())

    def action() -> tuple[dict[uuid.UUID, tuple], set[uuid.UUID]]:
        rows = _claim(sessions, lease_s, params)
        # the rest are duplicates, or must not run; only then is a second statement needed
        ended = []
        if rest := ids - {row.id for row in rows}:
            with sessions.begin() as session:
                ended = end_unrun(session, JOBS.c.id.in_(rest))
        return {row.id: row for row in rows}, {batch_id for _, batch_id in ended if batch_id is not None}

    rows, batches = retrying(action, f"claim {len(job_ids)} jobs")
    for batch_id in batches:
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    out: list[Claimed | None] = []
    for job_id in job_ids:
        row = rows.pop(uuid.UUID(job_id), None)
        if row is None:
            out.append(None)
            continue
        claimed = Claimed(row.id, None, row.created_at, row.batch_id, row.attempts, row.deadline_at, lease,
                          row.crashes, row.tenant)
        if row.attempts > max_attempts:
            fail(sessions, claimed, ErrorCode.engine_error,
                 f"gave up after {max_attempts} attempts; last error: {row.error_detail}")
            out.append(None)
            continue
        try:
            claimed.job = JobIn.model_validate(row.payload)
        except ValidationError as exc:
            fail(sessions, claimed, ErrorCode.invalid_prompt, f"the job's payload is not a valid job: {exc}")
            out.append(None)
            continue
        out.append(claimed)
    return out


@functools.cache
def _claim_statement(lease_s: float, postgres: bool) -> Executable:
    """The claim of `claim_many`, built once per lease length. Building and keying a statement of this size
    costs about a millisecond of CPU, more than the database spends running it. On PostgreSQL the same statement
    inserts the claimed jobs' `runs` rows (a data-modifying CTE). So a claim is one statement, committed on its
    own, one round trip instead of four (begin, claim, runs, commit). Its ids are one array parameter, so that its
    text is the same whatever their number. An expanded `IN` is rendered anew for each call, and past 50
    parameters the driver parses the whole text again each time."""
    jobs = JOBS
    lease = bindparam("claim_lease", type_=jobs.c.lease_id.type)
    worker = bindparam("claim_worker", type_=jobs.c.worker.type)
    now = bindparam("claim_now", type_=jobs.c.started_at.type)
    fresh = ((jobs.c.status == QUEUED) & jobs.c.cancel_requested_at.is_(None)
             & or_(jobs.c.deadline_at.is_(None), jobs.c.deadline_at > db_now()))
    ours = (jobs.c.status == RUNNING) & (jobs.c.lease_id == lease)
    ids = bindparam("claim_ids", type_=postgresql.ARRAY(jobs.c.id.type)) if postgres \
        else bindparam("claim_ids", expanding=True)
    claim = (update(jobs).where(jobs.c.id == any_(ids) if postgres else jobs.c.id.in_(ids), fresh | ours)
             .values(status=RUNNING, worker=worker, started_at=now, lease_id=lease, lease_expires_at=db_now(lease_s),
                     alone_at=None,
                     attempts=case((jobs.c.status == QUEUED, jobs.c.attempts + 1), else_=jobs.c.attempts))
             .returning(jobs.c.id, jobs.c.payload, jobs.c.created_at, jobs.c.batch_id, jobs.c.attempts,
                        jobs.c.error_detail, jobs.c.deadline_at, jobs.c.crashes, jobs.c.tenant))
    if not postgres:
        return claim
    claimed = claim.cte("claimed")
    runs = (postgresql.insert(RUNS)
            .from_select(["job_id", "lease_id", "worker", "started_at"], select(claimed.c.id, lease, worker, now),
                         include_defaults=False)
            .on_conflict_do_nothing())
    return select(claimed).add_cte(runs.cte("ran"))


def _claim(sessions: sessionmaker[Session], lease_s: float, params: dict) -> list[Row]:
    """The rows `claim_many` took, their `runs` rows inserted and committed."""
    bind = sessions.kw["bind"]
    if bind.dialect.name == "postgresql":
        with committing(bind) as conn:
            return conn.execute(_claim_statement(lease_s, True), params).all()
    with sessions.begin() as session:  # SQLite has no data-modifying CTE, so two statements in one transaction
        rows = session.execute(_claim_statement(lease_s, False), params).all()
        if rows:
            insert_ignore(session, Run, [dict(job_id=row.id, lease_id=params["claim_lease"],
                                              worker=params["claim_worker"], started_at=params["claim_now"])
                                         for row in rows])
        return rows


def end_unrun(session: Session, *where: ColumnElement[bool]) -> list[tuple[uuid.UUID, uuid.UUID | None]]:
    """End the queued jobs (among `where`) that must not run: a cancel was asked for (`cancelled`), or their
    deadline has passed on the database's clock (`expired`). Returns (job id, batch id) of each."""
    jobs = Job.__table__
    cancelled = jobs.c.cancel_requested_at.is_not(None)
    status = case((cancelled, JobStatus.cancelled.value), else_=JobStatus.expired.value)
    error = case((cancelled, ERROR_MESSAGES[ErrorCode.cancelled]), else_=ERROR_MESSAGES[ErrorCode.expired])
    return [tuple(row) for row in session.execute(
        update(jobs)
        .where(*where, jobs.c.status == QUEUED, or_(cancelled, jobs.c.deadline_at <= db_now()))
        .values(status=status, error=error, error_code=status, error_detail=None, finished_at=utcnow(),
                lease_id=None)
        .returning(jobs.c.id, jobs.c.batch_id)
    )]


def mark_alone(sessions: sessionmaker[Session], claimed: Claimed) -> bool:
    """Record that this run now has its worker to itself: if the worker dies from here on, the job did it."""
    return fenced_write(sessions, claimed, dict(alone_at=db_now()), None, "running alone", dict(alone=True))
