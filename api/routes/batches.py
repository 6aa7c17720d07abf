"""`/v1/batches`: bulk uploads in the OpenAI Batch format (or ours), their progress, results and errors."""

from __future__ import annotations

import io
import json
import logging
import re
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO, Annotated, TypeVar

from fastapi import APIRouter, BackgroundTasks, Header, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker, undefer
from starlette.datastructures import UploadFile

from api.batch_input import LineError, ParsedLine, parse_lines
from api.deps import V1_ERRORS, Caller, CeleryDep, SessionDep, SessionsDep, SettingsDep, errors, sees, visible
from api.openai_objects import chat_completion
from api.paging import list_of, page
from api.prompt_check import PromptCheck
from jobs.batch_settle import PENDING, settle_batch
from jobs.broker import broadcast_cancel
from jobs.db import retry_conflicts
from jobs.publish import publish
from jobs.schemas import (
    BATCH_SETTLED,
    DEFAULT_BATCH_PRIORITY,
    ENDPOINTS,
    BatchCreate,
    BatchLineError,
    BatchOut,
    BatchStatus,
    BatchUpload,
    JobStatus,
    ListOf,
    RequestCounts,
    ResultOut,
    window_seconds,
)
from jobs.settings import ApiKey, Settings
from jobs.tables import Batch, File, Job, Result, as_utc, job_row, utcnow
from jobs.tables import BatchLineError as LineErrorRow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=V1_ERRORS)

NOT_FOUND = errors(e404="No such batch (or another tenant's)")
INSERT_ROWS = 1000  # job and line-error rows per INSERT while a batch is ingested

OPEN = (BatchStatus.validating.value, BatchStatus.in_progress.value)
M = TypeVar("M", bound=BaseModel)


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(as_utc(moment).timestamp())


# A batch's output and error lines are files too (OpenAI's `output_file_id`, `error_file_id`): nothing is
# stored, their ids name the batch and their content is read from its jobs on each download.
BATCH_FILE = re.compile(r"file-([0-9a-f]{32})-(output|errors)")


def batch_file_id(batch_id: uuid.UUID, errors: bool) -> str:
    return f"file-{batch_id.hex}-{'errors' if errors else 'output'}"


def parse_batch_file_id(file_id: str) -> tuple[uuid.UUID, bool] | None:
    """(batch id, whether it is the error file) for a batch's output or error file id; None for any other id."""
    match = BATCH_FILE.fullmatch(file_id)
    return None if match is None else (uuid.UUID(match[1]), match[2] == "errors")


def _job_counts(session: Session, batch_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, int]]:
    """Each batch's jobs by status, in one query for a whole page of batches."""
    counts: dict[uuid.UUID, dict[str, int]] = {i: {} for i in batch_ids}
    for batch_id, job_status, n in session.execute(
            select(Job.batch_id, Job.status, func.count()).where(Job.batch_id.in_(batch_ids))
            .group_by(Job.batch_id, Job.status)):
        counts[batch_id][job_status] = n
    return counts


def batch_out(session: Session, batch: Batch, by_status: dict[str, int] | None = None) -> BatchOut:
    if by_status is None:
        by_status = _job_counts(session, [batch.id])[batch.id]
    counts = RequestCounts(
        total=batch.total,
        completed=by_status.get(JobStatus.succeeded.value, 0),
        failed=by_status.get(JobStatus.failed.value, 0) + batch.invalid_lines,
        invalid=batch.invalid_lines,
        cancelled=by_status.get(JobStatus.cancelled.value, 0),
        expired=by_status.get(JobStatus.expired.value, 0),
        pending=sum(by_status.get(s, 0) for s in PENDING),
    )
    # as OpenAI's: the files are named once they are final, and only when they have a line
    settled = batch.status in BATCH_SETTLED
    has_errors = counts.failed + counts.cancelled + counts.expired > 0
    return BatchOut(
        id=batch.id, status=BatchStatus(batch.status), priority=batch.priority, input_name=batch.input_name,
        input_file_id=batch.input_file_id,
        output_file_id=batch_file_id(batch.id, errors=False) if settled and counts.completed else None,
        error_file_id=batch_file_id(batch.id, errors=True) if settled and has_errors else None,
        request_counts=counts, metadata=batch.metadata_,
        completion_window=batch.completion_window, created_at=_unix(batch.created_at),
        expires_at=_unix(batch.expires_at), in_progress_at=_unix(batch.in_progress_at),
        finalizing_at=_unix(batch.finalizing_at), completed_at=_unix(batch.completed_at),
        cancelling_at=_unix(batch.cancelling_at), cancelled_at=_unix(batch.cancelled_at),
        failed_at=_unix(batch.failed_at), expired_at=_unix(batch.expired_at),
    )


def ingest(sessions: sessionmaker[Session], celery, settings: Settings, check: PromptCheck, batch_id: uuid.UUID,
           source: IO[bytes], caller: ApiKey) -> None:
    """Validate the upload line by line, create one job per good line, publish them (runs after the response).
    Lines are read, checked and inserted a thousand at a time, so memory holds one chunk, never the upload."""
    try:
        with sessions() as session:
            batch = session.get(Batch, batch_id)
            try:
                total, invalid = _store_lines(session, batch, check, source, caller)
            except Exception as exc:
                session.rollback()
                log.exception("batch %s could not be ingested", batch_id)
                session.execute(insert(LineErrorRow.__table__), {"batch_id": batch_id, "line": 0, "custom_id": None,
                                                                 "message": f"ingest failed: {type(exc).__name__}"})
                session.execute(update(Batch).where(Batch.id == batch_id).values(
                    status=BatchStatus.failed.value, failed_at=utcnow(), invalid_lines=1))
                session.commit()
                return
            now = utcnow()
            moved = (dict(status=BatchStatus.failed.value, failed_at=now) if total == invalid
                     else dict(status=BatchStatus.in_progress.value, in_progress_at=now))
            # only from `validating`, in the transaction that holds the jobs: a cancel either came first (and
            # nothing runs) or waits for this commit and then finds the jobs to cancel
            opened = session.execute(update(Batch).where(Batch.id == batch_id,
                                                         Batch.status == BatchStatus.validating.value)
                                     .values(total=total, invalid_lines=invalid, **moved))
            if opened.rowcount == 0:  # cancelled while validating: run nothing
                session.rollback()
                session.execute(update(Batch).where(Batch.id == batch_id).values(
                    status=BatchStatus.cancelled.value, cancelled_at=now, total=total))
                session.commit()
                return
            session.commit()
            # committed before any message exists; what a message needs is a few columns per job
            jobs = session.execute(select(Job.id, Job.kind, Job.priority).where(Job.batch_id == batch_id)).all()
            publish(celery, session, jobs, settings)
    finally:
        source.close()


def _store_lines(session: Session, batch: Batch, check: PromptCheck, source: IO[bytes],
                 caller: ApiKey) -> tuple[int, int]:
    """Insert a job per good line and a `BatchLineError` per bad one (uncommitted); (lines, bad lines)."""
    jobs: list[dict] = []
    bad: list[dict] = []
    total = invalid = 0
    now = utcnow()

    def flush() -> None:
        if jobs:
            session.execute(insert(Job.__table__), jobs)  # one statement run for every row
        if bad:
            session.execute(insert(LineErrorRow.__table__), bad)
        jobs.clear()
        bad.clear()

    for item in parse_lines(source, batch.priority):
        total += 1
        if isinstance(item, ParsedLine) and (problem := check.problem(item.job)):
            item = LineError(item.line, item.custom_id, f"{problem[0]}: {problem[1]}")
        if isinstance(item, ParsedLine):
            jobs.append(job_row(item.job, now, deadline_at=batch.expires_at, batch_id=batch.id,
                                custom_id=item.custom_id, owner=caller.digest, tenant=batch.tenant))
        else:
            invalid += 1
            bad.append({"batch_id": batch.id, "line": item.line, "custom_id": item.custom_id,
                        "message": item.message})
        if len(jobs) + len(bad) >= INSERT_ROWS:
            flush()
    flush()
    return total, invalid


def _get_batch(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> Batch:
    """The batch, or 404 when there is none or it is another tenant's (its existence is not revealed)."""
    batch = session.get(Batch, batch_id)
    if batch is None or not sees(caller, batch.tenant):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no batch {batch_id}")
    return batch


@dataclass
class BatchInput:
    """A new batch's lines and options, from either body of `POST /v1/batches`."""

    source: IO[bytes]  # the lines, at the start of a temporary file (or of the stored file's bytes)
    lines: int  # non-blank lines
    name: str | None
    input_file_id: str | None
    priority: int | None
    metadata: dict
    completion_window: str


def _validated(model: type[M], data: bytes | dict) -> M:
    """`data` as `model`, or the 422 FastAPI gives for a body it validates itself."""
    try:
        return model.model_validate_json(data) if isinstance(data, bytes) else model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


def _spool(lines: Iterable[bytes], settings: Settings) -> tuple[IO[bytes], int]:
    """`lines` copied into a temporary file, one line at a time, and their non-blank count; 413 past the
    upload limits. The caller owns (and closes) the file."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 (handed to the ingest, which closes it)
    size = count = 0
    try:
        for line in lines:
            size += len(line)
            count += bool(line.strip())
            if size > settings.max_upload_bytes or count > settings.max_batch_lines:
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                    f"a batch takes at most {settings.max_batch_lines} lines and "
                                    f"{settings.max_upload_bytes} bytes; split it into several batches")
            out.write(line)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out, count


async def _from_upload(request: Request, settings: Settings) -> BatchInput:
    # the multipart parser itself spools the file to disk past 1 MiB; it is copied (on disk) once more, since
    # the form's files are gone when this returns and the lines are read after the answer
    async with request.form(max_files=1, max_fields=16) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise RequestValidationError([{"loc": ("body", "file"), "msg": "a JSONL file is required",
                                           "type": "missing"}])
        fields = _validated(BatchUpload, {k: v for k, v in form.items() if k != "file"})
        source, lines = await run_in_threadpool(_spool, upload.file, settings)
    return BatchInput(source=source, lines=lines, name=upload.filename, input_file_id=None, priority=fields.priority,
                      metadata=fields.metadata or {}, completion_window=fields.completion_window)


def _from_file(session: Session, spec: BatchCreate, caller: ApiKey, settings: Settings) -> BatchInput:
    if spec.endpoint not in ENDPOINTS:
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"endpoint {spec.endpoint!r} is not served here; a batch may call {', '.join(ENDPOINTS)}")
    if parse_batch_file_id(spec.input_file_id) is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {spec.input_file_id} is a batch's results (purpose "
                                                         "batch_output); upload the requests with purpose=batch")
    file = session.get(File, spec.input_file_id, options=[undefer(File.content)])
    if file is None or not sees(caller, file.tenant):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no file {spec.input_file_id}")
    if file.purpose != "batch":
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"file {file.id} has purpose {file.purpose!r}; a batch's input needs purpose 'batch'")
    lines = sum(1 for line in io.BytesIO(file.content) if line.strip())
    if lines > settings.max_batch_lines:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {file.id} has {lines} lines; a batch takes at most "
                                                         f"{settings.max_batch_lines}: split it into several files")
    return BatchInput(source=io.BytesIO(file.content), lines=lines, name=file.filename, input_file_id=file.id,
                      priority=spec.priority, metadata=spec.metadata or {}, completion_window=spec.completion_window)


def _request_bodies() -> dict:
    """The two bodies `create_batch` reads itself, for the OpenAPI document."""
    upload = BatchUpload.model_json_schema()
    upload["properties"] = {"file": {"type": "string", "format": "binary",
                                     "description": "JSONL: OpenAI Batch lines or convoq lines"},
                            **upload["properties"]}
    upload["required"] = ["file"]
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": BatchCreate.model_json_schema()},
        "multipart/form-data": {"schema": upload, "encoding": {"metadata": {"contentType": "application/json"}}},
    }}}


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=BatchOut, openapi_extra=_request_bodies(),
             responses=errors(
                 e400="An input file that is not a batch input, or has more than CONVOQ_MAX_BATCH_LINES lines",
                 e404="No file input_file_id (or another tenant's)",
                 e413="The upload is larger than CONVOQ_MAX_UPLOAD_BYTES or has more than CONVOQ_MAX_BATCH_LINES lines",
                 e415="Neither application/json nor multipart/form-data",
                 e429="Rate limited, or its lines would pass the bound on unfinished jobs (see Retry-After)"))
async def create_batch(
    request: Request,
    background: BackgroundTasks,
    session: SessionDep,
    sessions: SessionsDep,
    celery: CeleryDep,
    settings: SettingsDep,
    caller: Caller,
    # typed `int` so the document says integer (a header is never JSON null); absent, it is None
    x_convoq_priority: Annotated[int, Header(  # noqa: RUF013
        ge=0, le=9, description="0..9, 9 most urgent; before the body's `priority` (multipart) or "
                                "`metadata.priority` (JSON); bulk work defaults low")] = None,
) -> BatchOut:
    """Create a batch from OpenAI's JSON body (`input_file_id`: a file uploaded with purpose `batch`, as the
    `openai` SDK sends it) or from a multipart/form-data upload of the JSONL itself (`file`, as our client and
    CLI send it). The lines are checked and run after the answer; bad lines are listed at
    `GET /v1/batches/{id}/line_errors`."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media == "multipart/form-data":
        given = await _from_upload(request, settings)
    elif media == "application/json":
        spec = _validated(BatchCreate, await request.body())
        given = await run_in_threadpool(_from_file, session, spec, caller, settings)  # may be many megabytes
    else:
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                            "send application/json with input_file_id (OpenAI's way) or multipart/form-data with "
                            "the JSONL as `file`")
    try:
        request.app.state.admission.admit(session, caller.digest, given.lines)
        window = timedelta(seconds=window_seconds(given.completion_window))
        now = utcnow()
        # the header first, as on /v1/chat/completions: it lets a caller set priority without touching the body
        priority = next(p for p in (x_convoq_priority, given.priority, DEFAULT_BATCH_PRIORITY) if p is not None)
        batch = Batch(priority=priority, input_name=given.name, input_file_id=given.input_file_id,
                      tenant=caller.tenant, status=BatchStatus.validating.value, total=0, invalid_lines=0,
                      metadata_=given.metadata, completion_window=given.completion_window, created_at=now,
                      expires_at=now + window)
        session.add(batch)
        session.commit()
    except BaseException:
        given.source.close()
        raise
    background.add_task(ingest, sessions, celery, settings, request.app.state.prompt_check, batch.id, given.source,
                        caller)
    return batch_out(session, batch)


@router.get("", response_model=ListOf[BatchOut], responses=errors(e404="`after` names no batch of this tenant"))
def list_batches(
    session: SessionDep,
    caller: Caller,
    after: Annotated[uuid.UUID | None, Query(description="the last id of the page before")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListOf[BatchOut]:
    """Batches, newest first, in OpenAI's list object."""
    batches, more = page(session, visible(select(Batch), Batch, caller), Batch, after, limit)
    counts = _job_counts(session, [b.id for b in batches])
    return list_of([batch_out(session, b, counts[b.id]) for b in batches], more)


@router.get("/{batch_id}", response_model=BatchOut, responses=NOT_FOUND)
def get_batch(batch_id: uuid.UUID, session: SessionDep, caller: Caller) -> BatchOut:
    batch = _get_batch(session, batch_id, caller)
    if batch.status in (BatchStatus.in_progress.value, BatchStatus.cancelling.value):
        settle_batch(session, batch_id)  # a safety net: workers settle batches too
        session.commit()
        session.refresh(batch)
    return batch_out(session, batch)


@router.post("/{batch_id}/cancel", response_model=BatchOut,
             responses={**NOT_FOUND, **errors(e409="The batch is no longer open (the detail names its status)")})
def cancel_batch(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, caller: Caller) -> BatchOut:
    """Queued items are cancelled and never run; running ones are stopped by their workers and end `cancelled`
    with the text they had. Finished items stay downloadable."""
    batch = _get_batch(session, batch_id, caller)
    if batch.status not in OPEN:
        raise HTTPException(status.HTTP_409_CONFLICT, f"batch is {batch.status}; only open batches can be cancelled")
    running = retry_conflicts(session, lambda: _cancel_jobs(session, batch_id))
    if running:
        try:
            broadcast_cancel(celery, running)
        except Exception:  # each worker also finds the requests in the rows at its next heartbeat
            log.exception("could not broadcast the cancel of batch %s", batch_id)
    settle_batch(session, batch_id)
    session.commit()
    session.refresh(batch)
    return batch_out(session, batch)


def _cancel_jobs(session: Session, batch_id: uuid.UUID) -> list[str]:
    """Mark the batch cancelling, cancel its queued jobs and ask for its running ones to stop; commits. Returns
    the ids of the running jobs."""
    now = utcnow()
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(OPEN))
                    .values(status=BatchStatus.cancelling.value, cancelling_at=now))
    # The jobs' rows are locked in id order first: claims and publish stamps lock theirs in that order (an
    # `id IN` list is scanned sorted), and two transactions locking the same rows in different orders deadlock.
    session.execute(select(Job.id).where(Job.batch_id == batch_id, Job.status.in_(PENDING))
                    .order_by(Job.id).with_for_update())
    session.execute(update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.queued.value)
                    .values(status=JobStatus.cancelled.value, finished_at=now, error="batch cancelled"))
    running = [str(i) for i in session.scalars(
        update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.running.value,
                          Job.cancel_requested_at.is_(None))
        .values(cancel_requested_at=now).returning(Job.id))]
    session.commit()
    return running


@router.post("/{batch_id}/retry", response_model=BatchOut,
             responses={**NOT_FOUND, **errors(e409="The batch is validating or cancelling; retry once it settles")})
def retry_failed(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, settings: SettingsDep,
                 caller: Caller) -> BatchOut:
    """Run the batch's failed jobs again (lines that failed validation cannot run: fix and upload those)."""
    batch = _get_batch(session, batch_id, caller)
    if batch.status in (BatchStatus.validating.value, BatchStatus.cancelling.value):
        raise HTTPException(status.HTTP_409_CONFLICT, f"batch is {batch.status}; retry once it settles")
    jobs = list(session.scalars(select(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.failed.value)))
    if jobs:
        for job in jobs:
            job.status, job.error, job.started_at, job.finished_at, job.published_at = "queued", None, None, None, None
        batch.status, batch.completed_at, batch.finalizing_at = BatchStatus.in_progress.value, None, None
        batch.in_progress_at = batch.in_progress_at or utcnow()
        session.commit()
        publish(celery, session, jobs, settings)
    return batch_out(session, batch)


def _completion(job: Job, result: Result, model: str) -> dict:
    body = chat_completion(f"chatcmpl-{job.id.hex}", _unix(result.created_at), model,
                           ResultOut.model_validate(result, from_attributes=True))
    return {**body, "convoq": {"chunks": result.chunks, "levels": result.levels}}


def batch_lines(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str) -> Iterator[bytes]:
    """The batch's output lines (succeeded items) or error lines (bad lines; failed, cancelled, expired items).
    The caller has checked that the batch is there for whoever asked."""
    with sessions() as session:
        if errors:
            for e in session.scalars(select(LineErrorRow).where(LineErrorRow.batch_id == batch_id)
                                     .order_by(LineErrorRow.line).execution_options(yield_per=INSERT_ROWS)):
                yield _line(f"batch_req_line{e.line}", e.custom_id, None,
                            {"code": "invalid_line", "message": f"line {e.line}: {e.message}"})
            wanted = (JobStatus.failed.value, JobStatus.cancelled.value, JobStatus.expired.value)
        else:
            wanted = (JobStatus.succeeded.value,)
        rows = session.execute(
            select(Job, Result).outerjoin(Result, Result.job_id == Job.id)
            .where(Job.batch_id == batch_id, Job.status.in_(wanted)).order_by(Job.custom_id)
            .execution_options(yield_per=500)
        )
        for job, result in rows:
            if errors:
                code = job.status if job.status in (JobStatus.cancelled, JobStatus.expired) else "job_failed"
                yield _line(f"batch_req_{job.id.hex}", job.custom_id, None, {"code": code, "message": job.error})
            else:
                response = {"status_code": 200, "request_id": str(job.id), "body": _completion(job, result, model)}
                yield _line(f"batch_req_{job.id.hex}", job.custom_id, response, None)


def _line(line_id: str, custom_id: str | None, response: dict | None, error: dict | None) -> bytes:
    return (json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error}) + "\n").encode()


JSONL = {200: {"description": "JSON Lines, one OpenAI Batch output line each", "content": {"application/jsonl": {}}}}


def batch_file(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str) -> StreamingResponse:
    """The batch's output or error lines as a download (the caller checked the batch is visible)."""
    return StreamingResponse(batch_lines(sessions, batch_id, errors, model), media_type="application/jsonl")


@router.get("/{batch_id}/output", response_class=StreamingResponse, responses={**JSONL, **NOT_FOUND})
def batch_output(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> StreamingResponse:
    """Succeeded items as OpenAI Batch output lines (available while the batch still runs)."""
    _get_batch(session, batch_id, caller)
    return batch_file(sessions, batch_id, False, settings.model)


@router.get("/{batch_id}/errors", response_class=StreamingResponse, responses={**JSONL, **NOT_FOUND})
def batch_errors(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> StreamingResponse:
    """Bad lines, failed, cancelled and expired items, as OpenAI Batch error lines (`error.code`: `invalid_line`,
    `job_failed`, `cancelled`, `expired`)."""
    _get_batch(session, batch_id, caller)
    return batch_file(sessions, batch_id, True, settings.model)


@router.get("/{batch_id}/line_errors", response_model=ListOf[BatchLineError], responses=NOT_FOUND)
def line_errors(
    batch_id: uuid.UUID,
    session: SessionDep,
    caller: Caller,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="the last line number of the page before")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ListOf[BatchLineError]:
    """The lines that could not become jobs, by line number, a page at a time (`request_counts.invalid` counts
    them)."""
    _get_batch(session, batch_id, caller)
    rows = list(session.scalars(select(LineErrorRow).where(LineErrorRow.batch_id == batch_id, LineErrorRow.line > after)
                                .order_by(LineErrorRow.line).limit(limit + 1)))
    found = [BatchLineError(line=r.line, custom_id=r.custom_id, message=r.message) for r in rows[:limit]]
    return ListOf(data=found, first_id=str(found[0].line) if found else None,
                  last_id=str(found[-1].line) if found else None, has_more=len(rows) > limit)
