"""The worker's writes: claiming a job under a lease, then storing what its run did, exactly once.

Delivery is at-least-once and a worker can lose a job without knowing it (frozen past its lease, cut off from
the database while the reconciler handed the job to another worker). So a claim takes a lease: a fencing token
(`jobs.lease_id`, new at every claim) with an expiry on the database's clock, renewed by the worker while it
runs the job. Every later write of the run (result, timings, retry, failure, running alone) is conditional on
the job still being `running` under that lease; a write that is not is refused, counted on the run's row
(`runs.stale_writes`) and logged, never applied. A write retried after its commit's reply was lost recognises
its own lease and reports what it did. Writes retry with backoff while the database is unreachable; the
Celery message is acknowledged only after the write returns.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from pydantic import ValidationError
from sqlalchemy import (
    JSON,
    ColumnElement,
    Connection,
    Engine,
    Executable,
    Row,
    Text,
    Update,
    Uuid,
    any_,
    bindparam,
    case,
    cast,
    column,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from engine.interface import Completion
from jobs.error_codes import ERROR_MESSAGES, STOPPED_MESSAGES, ErrorCode, error_columns
from jobs.schemas import JobIn
from jobs.status import JobStatus
from jobs.tables import Job, Result, Run, Timing, as_utc, utcnow
from jobs.tool_calls import finish_reason
from store.batch_settle import batch_pending, settle_batch
from store.clock import db_now
from store.writes import insert_ignore
from worker.outcome import STOPPED, Outcome

log = logging.getLogger(__name__)
T = TypeVar("T")
QUEUED, RUNNING, FAILED = JobStatus.queued.value, JobStatus.running.value, JobStatus.failed.value


@dataclass
class Claimed:
    job_id: uuid.UUID
    job: JobIn  # the payload, validated once at claim
    created_at: datetime
    batch_id: uuid.UUID | None
    attempt: int
    deadline_at: datetime | None = None
    lease: uuid.UUID | None = None  # the fencing token of this run: every write of the run names it
    crashes: int = 0  # earlier runs that ended with their worker
    tenant: str | None = None  # whose job it is: its requests share the prefix cache with that tenant's only


def ms_between(a: datetime, b: datetime) -> float:
    return (as_utc(b) - as_utc(a)).total_seconds() * 1e3


def retrying(action: Callable[[], T], what: str, deadline_s: float = 600.0) -> T:
    """Run a database action, retrying with capped exponential backoff while the database is away."""
    delay, start = 0.2, time.monotonic()
    while True:
        try:
            return action()
        except (OperationalError, DBAPIError) as exc:
            if time.monotonic() - start > deadline_s or not _transient(exc):
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1fs", what, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _transient(exc: DBAPIError) -> bool:
    return isinstance(exc, OperationalError) or exc.connection_invalidated


def storable(text: str) -> str:
    """PostgreSQL text cannot hold NUL, which a byte-level tokenizer can produce: store U+FFFD instead."""
    return text.replace("\x00", "\ufffd")


def holds(job_id: object, lease: object) -> ColumnElement[bool]:
    """The job is still `running` under the run's lease: the condition of every write of the run. Either may be
    a value, a bound parameter or a column of the rows a statement writes from."""
    jobs = Job.__table__
    return (jobs.c.id == job_id) & (jobs.c.lease_id == lease) & (jobs.c.status == RUNNING)


# The statements every job's claim and store run, built once at import: building and keying a statement costs
# more of a worker's CPU than the database spends running it (a claim of one job took 4.1 ms of CPU, 1.8 without)
_RUNS = Run.__table__
_END_RUNS = (update(_RUNS).where(_RUNS.c.job_id == bindparam("j"), _RUNS.c.lease_id == bindparam("l"))
             .values(outcome=bindparam("o"), ended_at=db_now()))
_JOBS = Job.__table__
# each job's row under a run's lease, and how the run's row says it ended: a write that finds its job no longer
# running recognises its own earlier try by both (a stall's hand-back keeps the lease too, and ends its run so)
_HELD = (select(_JOBS.c.id, _JOBS.c.status, _RUNS.c.outcome)
         .outerjoin(_RUNS, (_RUNS.c.job_id == _JOBS.c.id) & (_RUNS.c.lease_id == _JOBS.c.lease_id))
         .where(tuple_(_JOBS.c.id, _JOBS.c.lease_id).in_(bindparam("held", expanding=True)))
         .with_for_update(of=_JOBS))
_FINISH = (update(_JOBS)
           .where(holds(bindparam("job"), bindparam("lease")))
           .values(status=bindparam("new_status"), error=bindparam("new_error"), error_code=bindparam("new_code"),
                   error_detail=bindparam("new_detail"), finished_at=bindparam("now"), lease_expires_at=None))


def end_runs(session: Session, done: list[tuple[uuid.UUID, uuid.UUID, str]]) -> None:
    """Record how runs ended: (job id, lease id, outcome) each."""
    if not done:
        return
    session.connection().execute(_END_RUNS, [dict(j=job_id, l=lease, o=outcome) for job_id, lease, outcome in done])


def _refuse(session: Session, refused: list[Claimed], what: str) -> None:
    """Writes of runs that lost their lease: counted on the run's row and logged, not applied."""
    if not refused:
        return
    runs = Run.__table__
    session.connection().execute(
        update(runs).where(runs.c.job_id == bindparam("j"), runs.c.lease_id == bindparam("l"))
        .values(stale_writes=runs.c.stale_writes + 1),
        [dict(j=c.job_id, l=c.lease) for c in refused],
    )
    log.warning("refused %s of %d jobs whose lease this worker no longer holds: %s", what, len(refused),
                ", ".join(str(c.job_id) for c in refused[:10]))


def _fenced(sessions: sessionmaker[Session], claimed: Claimed, values: dict, done: str | None, what: str,
            run: dict) -> bool:
    """Apply `values` to the job while this run holds it, and `run` to the run's row; True if applied, now or by
    an earlier try of this write whose reply was lost (the job is in status `done` under this lease and its run
    ended as `run` says: a stall's hand-back, which keeps the lease, is not this write). A refused write is
    recorded."""
    jobs, runs = Job.__table__, Run.__table__

    def action() -> bool:
        with sessions.begin() as session:
            fenced = update(jobs).where(holds(claimed.job_id, claimed.lease)).values(**values)
            applied = session.execute(fenced).rowcount == 1
            if not applied and done is not None:
                found = session.execute(_HELD, {"held": [(claimed.job_id, claimed.lease)]}).first()
                applied = found is not None and (found.status, found.outcome) == (done, run.get("outcome"))
            if applied:
                session.execute(update(runs).where(runs.c.job_id == claimed.job_id, runs.c.lease_id == claimed.lease)
                                .values(**run))
            else:
                _refuse(session, [claimed], what)
            return applied

    return retrying(action, f"{what} {claimed.job_id}")


def ended(outcome: str) -> dict:
    """A run's row once it ended so."""
    return dict(outcome=outcome, ended_at=db_now())


def returned(crashes: ColumnElement[int] | int = 0) -> dict:
    """The columns of a running job sent back to `queued` because its run ended with its worker: not an attempt
    (the claim's is refunded), `crashes` more crashes."""
    jobs = Job.__table__
    return dict(status=QUEUED, worker=None, published_at=None, lease_expires_at=None, alone_at=None,
                attempts=jobs.c.attempts - 1, crashes=jobs.c.crashes + crashes)


def error_of(code: ErrorCode, detail: str) -> dict[str, str | None]:
    """The error columns of a job that `detail` (what raised, for operators) made fail with `code`."""
    return error_columns(code, detail=storable(detail)[:4000])


def sent_on() -> dict:
    """The columns of a job going back to `queued` whose writer sends its message itself, at once (a retry's,
    a stall's) or by returning it to the queue (a shutdown's): published from this moment, so a sweep judges
    it from when it went back, not from its creation, and sends a second message only once that one is missing.
    The writer's `publish(..., stamped=True)` takes the stamp back if its message does not go out."""
    return dict(published_at=db_now(), message_missing_at=None)


def fail(sessions: sessionmaker[Session], claimed: Claimed, code: ErrorCode, detail: str) -> bool:
    """A job whose run raised: it ends `failed` with `code` instead of staying `running` forever, what raised
    kept as its `error_detail`. False if the run no longer holds the job (the write was refused)."""
    values = dict(status=FAILED, finished_at=utcnow(), lease_expires_at=None, **error_of(code, detail))
    applied = _fenced(sessions, claimed, values, FAILED, "failure", ended("failed"))
    if applied and claimed.batch_id is not None:
        retrying(lambda: settle(sessions, claimed.batch_id), f"settle batch {claimed.batch_id}")
    return applied


def requeue(sessions: sessionmaker[Session], claimed: Claimed, detail: str) -> bool:
    """Put a job whose attempt raised (`detail`: what raised) back to `queued` (for a delayed retry); False if this
    run no longer holds it. The lease stays on the row only so that a retry of this write recognises it; a claim
    replaces it."""
    values = dict(status=QUEUED, worker=None, lease_expires_at=None, **sent_on(),
                  **error_of(ErrorCode.engine_error, detail))
    return _fenced(sessions, claimed, values, QUEUED, "retry", ended("retry"))


def give_back(sessions: sessionmaker[Session], claimed: Claimed, requeued: bool = False) -> bool:
    """A run its live worker ends without an outcome (it lost the job's lease, or it is shutting down): the job
    goes back to `queued` uncharged, neither an attempt nor a crash (its worker did not die), unless it moved on
    meanwhile, in which case the write is refused. `requeued`: the caller returns the job's message to the queue,
    so the row says it is published and a sweep sends no second one."""
    values = returned() | (sent_on() if requeued else {})
    return _fenced(sessions, claimed, values, QUEUED, "hand-back", ended("returned"))


def lost_run_updates(keep_lease: bool = False, code: ErrorCode = ErrorCode.crashed) -> tuple[Update, Update]:
    """The fenced statements (`j`: job id, `l`: the run's lease) that end a run its worker can no longer finish
    (its lease expired, its engine stalled): the job goes back to `queued`, charged `charge` crashes, or fails
    with `code` (`e`: why, its detail), a crash past the last one. `keep_lease`: the lease stays on the row, so
    that the writer, retrying after a lost reply, recognises its own hand-back (a stall's, from the worker that
    holds the run)."""
    jobs = Job.__table__
    fenced = holds(bindparam("j"), bindparam("l"))
    lease = {} if keep_lease else {"lease_id": None}
    back = update(jobs).where(fenced).values(**returned(crashes=bindparam("charge")), **lease)
    failed = update(jobs).where(fenced).values(
        status=FAILED, error=ERROR_MESSAGES[code], error_code=code.value, error_detail=bindparam("e"),
        finished_at=db_now(), lease_expires_at=None, crashes=jobs.c.crashes + 1, **lease)
    return back, failed


STALLED = "stalled"  # how a run ends when its engine stalled with it inside and was killed


def stalled(sessions: sessionmaker[Session], claims: list[Claimed], max_crashes: int,
            sends: bool = False) -> dict[uuid.UUID, JobStatus]:
    """Jobs whose engine stalled with them in it go back to `queued`, neither an attempt (the claim's is
    refunded) nor a crash: one stall says nothing about which request caused it. A job whose earlier run stalled
    too is charged a crash (the suspect rules follow from there), and fails if that makes `max_crashes`. A job
    that ran alone (`mark_alone`: a suspect) is condemned, as a worker's death while it runs alone condemns it:
    nothing else was in the engine, so it fails, charged the crash, instead of stalling engines until its crashes
    run out. Each run ends `stalled`. Returns the status each job was left in; the runs that no longer hold their
    job are refused and left out. `sends`: the caller sends the jobs left queued again itself (`sent_on`), else
    a sweep does."""
    jobs, runs = Job.__table__, Run.__table__
    pairs = [(c.job_id, c.lease) for c in claims]
    back, failed = lost_run_updates(keep_lease=True, code=ErrorCode.timeout)
    back = back.values(**sent_on()) if sends else back

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
            _refuse(session, [c for c in claims if c.job_id not in left], "stall hand-back")
        return left, batches - {None}

    left, batches = retrying(action, f"hand back {len(claims)} jobs of a stalled engine")
    for batch_id in batches:
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    return left


def mark_alone(sessions: sessionmaker[Session], claimed: Claimed) -> bool:
    """Record that this run now has its worker to itself: if the worker dies from here on, the job did it."""
    return _fenced(sessions, claimed, dict(alone_at=db_now()), None, "running alone", dict(alone=True))


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


def claim(sessions: sessionmaker[Session], job_id: str, worker: str, max_attempts: int,
          lease_s: float = 30.0) -> Claimed | None:
    """Take a queued job under a new lease; None if it is not queued (a duplicate message, or already taken)."""
    return claim_many(sessions, [job_id], worker, max_attempts, lease_s)[0]


@functools.cache
def _claim_statement(lease_s: float, postgres: bool) -> Executable:
    """The claim of `claim_many`, built once per lease length: building and keying a statement of this size costs
    about a millisecond of CPU, more than the database spends running it. On PostgreSQL, the same statement
    inserts the claimed jobs' `runs` rows (a data-modifying CTE), so that a claim is one statement, committed on
    its own: one round trip instead of four (begin, claim, runs, commit); and its ids are one array parameter,
    so that its text is the same whatever their number (an expanded `IN` is rendered anew for each call, and
    past 50 parameters the driver parses the whole text again each time)."""
    jobs = _JOBS
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
    runs = (postgresql.insert(_RUNS)
            .from_select(["job_id", "lease_id", "worker", "started_at"], select(claimed.c.id, lease, worker, now),
                         include_defaults=False)
            .on_conflict_do_nothing())
    return select(claimed).add_cte(runs.cte("ran"))


def _claim(sessions: sessionmaker[Session], lease_s: float, params: dict) -> list[Row]:
    """The rows `claim_many` took, their `runs` rows inserted and committed."""
    bind = sessions.kw["bind"]
    if bind.dialect.name == "postgresql":
        with _committing(bind) as conn:
            return conn.execute(_claim_statement(lease_s, True), params).all()
    with sessions.begin() as session:  # SQLite: no data-modifying CTE, so two statements in one transaction
        rows = session.execute(_claim_statement(lease_s, False), params).all()
        if rows:
            insert_ignore(session, Run, [dict(job_id=row.id, lease_id=params["claim_lease"],
                                              worker=params["claim_worker"], started_at=params["claim_now"])
                                         for row in rows])
        return rows


def _committing(bind: Engine) -> Connection:
    """A connection whose every statement commits on its own: a write that is one statement needs neither BEGIN nor
    COMMIT, each a round trip of its own."""
    return bind.connect().execution_options(isolation_level="AUTOCOMMIT")


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
                ended = end_unrun(session, _JOBS.c.id.in_(rest))
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


@dataclass
class Stored:
    """What `store` wrote: the job's final status and, for a successful job, its timings row. `applied` is
    False when the run had lost the job: nothing was written."""

    status: JobStatus
    timing: dict | None
    applied: bool = True


def finished_status(completion: Completion) -> JobStatus:
    if completion.finish_reason in STOPPED:
        return JobStatus(completion.finish_reason)
    return JobStatus.succeeded if completion.ok else JobStatus.failed


def timing_row(claimed: Claimed, outcome: Outcome, worker: str, now: datetime) -> dict:
    """The job's timings: queue wait and time to first token count from the job's creation (the engine's clock
    starts there: `Bridge.submit`)."""
    t = outcome.completion.timings
    busy_s = (t.prefill_ms + t.decode_ms) / 1e3
    return dict(
        job_id=claimed.job_id,
        queue_wait_ms=t.queue_wait_ms,
        ttft_ms=t.ttft_ms,
        prefill_ms=t.prefill_ms,
        decode_ms=t.decode_ms,
        engine_ms=outcome.engine_ms,
        end_to_end_ms=ms_between(claimed.created_at, now),
        tokens_per_s=outcome.completion_tokens / busy_s if busy_s > 0 else 0.0,
        engine_step=f"{worker}:{t.first_step}" if t.first_step >= 0 else None,
        batch_size=t.batch_size,
        prompt_tokens_reused=t.prompt_tokens_reused,
        host_tokens_reused=t.host_tokens_reused,
        created_at=now,
    )


def store(sessions: sessionmaker[Session], claimed: Claimed, outcome: Outcome, worker: str) -> Stored:
    return store_many(sessions, [(claimed, outcome)], worker)[0]


def _choice(outcome: Outcome) -> dict:
    """One answer as stored: a result row's own columns (choice 0), or an entry of its `choices`."""
    c = outcome.completion
    reasoning = None if outcome.reasoning is None else storable(outcome.reasoning)
    return dict(text=storable(c.text), reasoning=reasoning, completion_tokens=len(c.token_ids),
                finish_reason=finish_reason(c.finish_reason, outcome.tool_calls), logprobs=outcome.logprobs,
                tool_calls=outcome.tool_calls)


def _result_row(claimed: Claimed, outcome: Outcome, now: datetime) -> dict:
    return dict(_choice(outcome), job_id=claimed.job_id, prompt_tokens=outcome.completion.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
                choices=[_choice(choice) for choice in outcome.choices] or None,
                created_at=now, chunks=outcome.chunks, levels=outcome.levels)


@dataclass
class _Write:
    """What storing one finished job writes, if its run still holds it."""

    claimed: Claimed
    status: JobStatus
    timing: dict | None  # its timings row: a job that succeeded
    result: dict | None  # its result row: a job that succeeded, or stopped with the text it had
    finished: dict  # the fenced update of its row (`_FINISH`'s parameters)


def stored_error(outcome: Outcome) -> dict[str, str | None]:
    """The error columns of a finished run's job: none for a success. A failure that comes this far is its
    request's (the engine's own were retried), told in the words that checked it; a run stopped part way says
    that its text is kept."""
    c = outcome.verdict
    if c.ok:
        return dict(error=None, error_code=None, error_detail=None)
    if c.finish_reason in STOPPED:
        code = ErrorCode(c.finish_reason)
        return error_columns(code, STOPPED_MESSAGES[code])
    return error_columns(outcome.code or ErrorCode.invalid_prompt, c.error and storable(c.error))


def _write_of(claimed: Claimed, outcome: Outcome, worker: str, now: datetime) -> _Write:
    c = outcome.verdict
    status = finished_status(c)
    error = stored_error(outcome)
    return _Write(claimed, status,
                  timing_row(claimed, outcome, worker, now) if c.ok else None,
                  _result_row(claimed, outcome, now) if c.ok or c.finish_reason in STOPPED else None,
                  dict(job=claimed.job_id, lease=claimed.lease, new_status=status.value, new_error=error["error"],
                       new_code=error["error_code"], new_detail=error["error_detail"], now=now))


def store_many(sessions: sessionmaker[Session], done: list[tuple[Claimed, Outcome]], worker: str) -> list[Stored]:
    """Results, timings and final statuses of finished jobs, all or nothing; then their batches settle.

    Only jobs their run still holds are written: the update of their rows is fenced by the lease, and their
    results, timings and runs are written with it: in one statement on PostgreSQL (`_store_statement`); on
    SQLite in one transaction, its rows locked first. A job this write already finished (a retry after a lost
    reply) counts as written; the rest are refused and nothing of theirs is stored.
    """
    def action() -> list[Stored]:
        now = utcnow()
        writes = [_write_of(claimed, outcome, worker, now) for claimed, outcome in done]
        stored = _store(sessions, writes, now)
        return [Stored(w.status, w.timing if w.claimed.job_id in stored else None, w.claimed.job_id in stored)
                for w in writes]

    stored = retrying(action, f"store {len(done)} jobs")
    for batch_id in dict.fromkeys(c.batch_id for (c, _), s in zip(done, stored, strict=True)
                                  if c.batch_id is not None and s.applied):
        retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
    return stored


def _store(sessions: sessionmaker[Session], writes: list[_Write], now: datetime) -> set[uuid.UUID]:
    """Apply `writes` to the jobs their runs still hold; returns the ids written, now or by an earlier try."""
    bind = sessions.kw["bind"]
    if bind.dialect.name != "postgresql":
        return _store_in_transaction(sessions, writes)
    params = dict(finished=_json([w.finished for w in writes]), now=now,
                  results=_json([w.result for w in writes if w.result is not None], _json_columns(Result)),
                  timings=_json([w.timing for w in writes if w.timing is not None], _json_columns(Timing)))
    with _committing(bind) as conn:
        written = set(conn.execute(_store_statement(), params).scalars())
    if len(written) == len(writes):
        return written
    with sessions.begin() as session:  # the jobs it did not update: finished by this write's earlier try, or lost
        missing = [w.claimed for w in writes if w.claimed.job_id not in written]
        held = session.execute(_HELD, {"held": [(c.job_id, c.lease) for c in missing]}).all()
        written |= _written_before(writes, held)
        _refuse(session, [c for c in missing if c.job_id not in written], "result")
    return written


def _written_before(writes: list[_Write], found: list[Row]) -> set[uuid.UUID]:
    """Of the jobs `_HELD` found under their runs' leases, those an earlier try of these writes finished: in the
    status the write sets, their runs ended with it. Any other state (a stall's hand-back left the job queued
    under the same lease) is not this write's, and is refused."""
    meant = {w.claimed.job_id: w.status.value for w in writes}
    return {job_id for job_id, status, outcome in found if status == outcome == meant.get(job_id)}


def _json(rows: list[dict], nested: frozenset[str] = frozenset()) -> str:
    """Rows as one JSON parameter: ids and times as text, which PostgreSQL reads back into their columns, and the
    values of the `nested` columns (a table's JSON columns: `_json_columns`) as their JSON text."""
    if nested:
        rows = [{k: json.dumps(v) if k in nested and v is not None else v for k, v in row.items()} for row in rows]
    return json.dumps(rows, default=str, ensure_ascii=False)


@functools.cache
def _json_columns(table) -> frozenset[str]:
    """A table's JSON columns. PostgreSQL de-escapes every string of a JSON parameter it reads rows from, and a
    text cannot hold the NUL that a result's log-probabilities can (a byte-level token); as JSON text, a
    column's value keeps its escape until it is stored in a JSON column, which can hold it."""
    return frozenset(c.name for c in table.__table__.columns if isinstance(c.type, JSON))


@functools.cache
def _store_statement() -> Executable:
    """`store_many` on PostgreSQL as one statement, committed on its own: one round trip for any number of jobs.
    The rows come as JSON parameters (`finished`, `results`, `timings`); the jobs' fenced update returns the ids
    it changed, and only their results, timings and runs are written (data-modifying CTEs on its RETURNING).
    Each row carries every column of its table: a column it left out would be NULL, not its default."""
    jobs, runs = _JOBS, _RUNS
    rows = (func.json_to_recordset(_json_param("finished"))
            .table_valued(column("job", Uuid), column("lease", Uuid), column("new_status", Text),
                          column("new_error", Text), column("new_code", Text), column("new_detail", Text))
            .render_derived("v", with_types=True))
    fin = (update(jobs)
           .where(holds(rows.c.job, rows.c.lease))
           .values(status=rows.c.new_status, error=rows.c.new_error, error_code=rows.c.new_code,
                   error_detail=rows.c.new_detail, finished_at=bindparam("now"), lease_expires_at=None)
           .returning(jobs.c.id, jobs.c.lease_id, jobs.c.status)
           .cte("fin"))
    ran = (update(runs).where(runs.c.job_id == fin.c.id, runs.c.lease_id == fin.c.lease_id)
           .values(outcome=fin.c.status, ended_at=db_now()).cte("ran"))

    def insert(table, name: str) -> Executable:
        nested, columns = _json_columns(table), table.__table__.columns
        given = (func.json_to_recordset(_json_param(name))
                 .table_valued(*(column(c.name, Text if c.name in nested else c.type) for c in columns))
                 .render_derived(f"{name}_rows", with_types=True))
        values = [cast(given.c[c.name], JSON) if c.name in nested else given.c[c.name] for c in columns]
        return (postgresql.insert(table)
                .from_select([c.name for c in columns], select(*values).join(fin, fin.c.id == given.c.job_id))
                .on_conflict_do_nothing().cte(f"{name}_in"))

    return select(fin.c.id).add_cte(ran, insert(Result, "results"), insert(Timing, "timings"))


def _json_param(name: str) -> ColumnElement:
    """A parameter `_json` made: sent as text, read as JSON."""
    return cast(bindparam(name, type_=Text), JSON)


def _store_in_transaction(sessions: sessionmaker[Session], writes: list[_Write]) -> set[uuid.UUID]:
    """`_store` where a statement cannot write several tables (SQLite): the jobs' rows locked, then one statement
    per table."""
    with sessions.begin() as session:
        found = session.execute(_HELD, {"held": [(w.claimed.job_id, w.claimed.lease) for w in writes]}).all()
        held = {job_id: status for job_id, status, _ in found}
        live = [w for w in writes if held.get(w.claimed.job_id) == RUNNING]
        before = _written_before(writes, found)
        if rows := [w.result for w in live if w.result is not None]:
            insert_ignore(session, Result, rows)
        if rows := [w.timing for w in live if w.timing is not None]:
            insert_ignore(session, Timing, rows)
        if live:
            session.connection().execute(_FINISH, [w.finished for w in live])
            end_runs(session, [(w.claimed.job_id, w.claimed.lease, w.status.value) for w in live])
        written = {w.claimed.job_id for w in live} | before
        _refuse(session, [w.claimed for w in writes if w.claimed.job_id not in written], "result")
    return written


def settle(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> None:
    """`settle_batch` in a transaction of its own, once the batch has no job left pending. Until then (every store
    but a batch's last) the check is one statement committed on its own: a transaction around it would add a
    BEGIN and a COMMIT, each a round trip of the worker's store thread."""
    with _committing(sessions.kw["bind"]) as conn:
        if batch_pending(conn, batch_id):
            return
    with sessions.begin() as session:
        settle_batch(session, batch_id)


