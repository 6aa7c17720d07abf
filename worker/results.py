"""Storing what a finished run did, exactly once. Its result, its timings and its job's final status go in one
write, fenced by the run's lease (`worker.fence`)."""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    JSON,
    ColumnElement,
    Executable,
    Row,
    Text,
    Uuid,
    bindparam,
    cast,
    column,
    func,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from engine.interface import Completion
from jobs.error_codes import STOPPED_MESSAGES, ErrorCode, error_columns
from jobs.status import JobStatus
from jobs.tables import Result, Timing, as_utc, utcnow
from jobs.tool_calls import finish_reason
from store.clock import db_now
from store.writes import insert_ignore
from worker.database import committing, retrying, settle, storable
from worker.fence import HELD, JOBS, RUNNING, RUNS, Claimed, end_runs, holds, refuse
from worker.outcome import STOPPED, Outcome


def ms_between(a: datetime, b: datetime) -> float:
    return (as_utc(b) - as_utc(a)).total_seconds() * 1e3


_FINISH = (update(JOBS)
           .where(holds(bindparam("job"), bindparam("lease")))
           .values(status=bindparam("new_status"), error=bindparam("new_error"), error_code=bindparam("new_code"),
                   error_detail=bindparam("new_detail"), finished_at=bindparam("now"), lease_expires_at=None))


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
    timing: dict | None  # its timings row, for a job that succeeded
    result: dict | None  # its result row, for a job that succeeded or stopped with the text it had
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

    Only jobs their run still holds are written. The update of their rows is fenced by the lease, and their
    results, timings and runs are written with it. On PostgreSQL that is one statement (`_store_statement`); on
    SQLite it is one transaction, its rows locked first. A job this write already finished (a retry after a lost
    reply) counts as written. The rest are refused, and nothing of theirs is stored.
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
    with committing(bind) as conn:
        written = set(conn.execute(_store_statement(), params).scalars())
    if len(written) == len(writes):
        return written
    with sessions.begin() as session:  # the jobs it did not update were finished before, or lost
        missing = [w.claimed for w in writes if w.claimed.job_id not in written]
        held = session.execute(HELD, {"held": [(c.job_id, c.lease) for c in missing]}).all()
        written |= _written_before(writes, held)
        refuse(session, [c for c in missing if c.job_id not in written], "result")
    return written


def _written_before(writes: list[_Write], found: list[Row]) -> set[uuid.UUID]:
    """Of the jobs `HELD` found under their runs' leases, those an earlier try of these writes finished: in the
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
    """`store_many` on PostgreSQL as one statement, committed on its own, so one round trip for any number
    of jobs. The rows come as JSON parameters (`finished`, `results`, `timings`). The jobs' fenced update returns
    the ids it changed, and only their results, timings and runs are written (data-modifying CTEs on its
    RETURNING). Each row carries every column of its table, because a column it left out would be NULL, not its
    default."""
    jobs, runs = JOBS, RUNS
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
        found = session.execute(HELD, {"held": [(w.claimed.job_id, w.claimed.lease) for w in writes]}).all()
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
        refuse(session, [w.claimed for w in writes if w.claimed.job_id not in written], "result")
    return written
