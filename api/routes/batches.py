"""`/v1/batches`: bulk uploads in the OpenAI Batch format (or ours), their progress, results and errors."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, File, Form, HTTPException, Request, UploadFile, status
from fastapi.responses import StreamingResponse
from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.batch_input import LineError, parse_batch
from api.deps import AUTH_ERRORS, CeleryDep, ReadKey, SessionDep, SessionsDep, SettingsDep, SubmitKey
from api.prompt_check import PromptCheck
from jobs.batches import PENDING, settle_batch
from jobs.broker import broadcast_cancel
from jobs.publish import publish
from jobs.schemas import (
    DEFAULT_BATCH_PRIORITY,
    DEFAULT_COMPLETION_WINDOW,
    BatchLineError,
    BatchOut,
    BatchStatus,
    JobStatus,
    RequestCounts,
    window_seconds,
)
from jobs.settings import Settings
from jobs.tables import Batch, Job, Result, as_utc, job_row, utcnow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches", tags=["batches"])

OPEN = (BatchStatus.validating.value, BatchStatus.in_progress.value)


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(as_utc(moment).timestamp())


def batch_out(session: Session, batch: Batch) -> BatchOut:
    by_status = dict(
        session.execute(
            select(Job.status, func.count()).where(Job.batch_id == batch.id).group_by(Job.status)
        ).all()
    )
    bad_lines = len(batch.line_errors)
    counts = RequestCounts(
        total=batch.total,
        completed=by_status.get(JobStatus.succeeded.value, 0),
        failed=by_status.get(JobStatus.failed.value, 0) + bad_lines,
        cancelled=by_status.get(JobStatus.cancelled.value, 0),
        expired=by_status.get(JobStatus.expired.value, 0),
        pending=sum(by_status.get(s, 0) for s in PENDING),
    )
    return BatchOut(
        id=batch.id, status=BatchStatus(batch.status), priority=batch.priority, input_name=batch.input_name,
        request_counts=counts, errors=[BatchLineError(**e) for e in batch.line_errors], metadata=batch.metadata_,
        completion_window=batch.completion_window, created_at=_unix(batch.created_at),
        expires_at=_unix(batch.expires_at), in_progress_at=_unix(batch.in_progress_at),
        finalizing_at=_unix(batch.finalizing_at), completed_at=_unix(batch.completed_at),
        cancelling_at=_unix(batch.cancelling_at), cancelled_at=_unix(batch.cancelled_at),
        failed_at=_unix(batch.failed_at), expired_at=_unix(batch.expired_at),
    )


def ingest(sessions: sessionmaker[Session], celery, settings: Settings, check: PromptCheck, batch_id: uuid.UUID,
           data: bytes, owner: str) -> None:
    """Validate the upload line by line, create one job per good line, publish them (runs after the response)."""
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        try:
            parsed, errors, total = parse_batch(data, batch.priority)
            for p in list(parsed):
                if problem := check.problem(p.job):
                    parsed.remove(p)
                    errors.append(LineError(p.line, p.custom_id, f"{problem[0]}: {problem[1]}"))
            errors.sort(key=lambda e: e.line)
            now = utcnow()
            rows = [job_row(p.job, now, deadline_at=batch.expires_at, batch_id=batch_id, custom_id=p.custom_id,
                            owner=owner) for p in parsed]
            batch.total, batch.line_errors = total, [e.as_dict() for e in errors]
            if not rows:
                batch.status, batch.failed_at = BatchStatus.failed.value, now
            elif batch.status == BatchStatus.validating.value:
                batch.status, batch.in_progress_at = BatchStatus.in_progress.value, now
                session.execute(insert(Job.__table__), rows)  # one statement run for every row
            else:  # cancelled while validating: record the lines, run nothing
                batch.status, batch.cancelled_at = BatchStatus.cancelled.value, now
                rows = []
            session.commit()
            jobs = [Job(**row) for row in rows]
        except Exception as exc:
            session.rollback()
            log.exception("batch %s could not be ingested", batch_id)
            session.execute(update(Batch).where(Batch.id == batch_id).values(
                status=BatchStatus.failed.value, failed_at=utcnow(),
                line_errors=[{"line": 0, "custom_id": None, "message": f"ingest failed: {type(exc).__name__}"}],
            ))
            session.commit()
            return
        publish(celery, session, jobs, settings)


def _get_batch(session: Session, batch_id: uuid.UUID) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no batch {batch_id}")
    return batch


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=BatchOut,
             responses={**AUTH_ERRORS, 413: {"description": "The upload is larger than CONVOQ_MAX_UPLOAD_BYTES"},
                        429: {"description": "Rate limited, or its lines would pass the bound on unfinished jobs"}})
async def create_batch(
    file: Annotated[UploadFile, File(description="JSONL: OpenAI Batch lines or convoq lines")],
    request: Request,
    background: BackgroundTasks,
    session: SessionDep,
    sessions: SessionsDep,
    celery: CeleryDep,
    settings: SettingsDep,
    key: SubmitKey,
    priority: Annotated[int, Form(ge=0, le=9, description="0..9, 9 most urgent; bulk work defaults low")] = DEFAULT_BATCH_PRIORITY,
    metadata: Annotated[str | None, Form(description="a JSON object kept with the batch")] = None,
    completion_window: Annotated[str, Form(
        description="how long the batch may take, as OpenAI's '24h' (also '90m', '2d'); items unfinished by then "
                    "end `expired`")] = DEFAULT_COMPLETION_WINDOW,
) -> BatchOut:
    data = await file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise HTTPException(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                            f"the upload exceeds {settings.max_upload_bytes} bytes; split it into several batches")
    try:
        meta = json.loads(metadata) if metadata else {}
        if not isinstance(meta, dict):
            raise ValueError
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "metadata must be a JSON object") from exc
    try:
        window = timedelta(seconds=window_seconds(completion_window))
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    request.app.state.admission.admit(session, key, sum(1 for line in data.splitlines() if line.strip()))
    now = utcnow()
    batch = Batch(priority=priority, input_name=file.filename, status=BatchStatus.validating.value,
                  total=0, line_errors=[], metadata_=meta, completion_window=completion_window, created_at=now,
                  expires_at=now + window)
    session.add(batch)
    session.commit()
    background.add_task(ingest, sessions, celery, settings, request.app.state.prompt_check, batch.id, data, key)
    return batch_out(session, batch)


@router.get("/{batch_id}", response_model=BatchOut)
def get_batch(batch_id: uuid.UUID, session: SessionDep, _: ReadKey) -> BatchOut:
    batch = _get_batch(session, batch_id)
    if batch.status in (BatchStatus.in_progress.value, BatchStatus.cancelling.value):
        settle_batch(session, batch_id)  # a safety net: workers settle batches too
        session.commit()
        session.refresh(batch)
    return batch_out(session, batch)


@router.post("/{batch_id}/cancel", response_model=BatchOut,
             responses={**AUTH_ERRORS, 404: {"description": "No such batch"},
                        409: {"description": "The batch is no longer open (the detail names its status)"}})
def cancel_batch(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, _: SubmitKey) -> BatchOut:
    """Queued items are cancelled and never run; running ones are stopped by their workers and end `cancelled`
    with the text they had. Finished items stay downloadable."""
    batch = _get_batch(session, batch_id)
    if batch.status not in OPEN:
        raise HTTPException(status.HTTP_409_CONFLICT, f"batch is {batch.status}; only open batches can be cancelled")
    now = utcnow()
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(OPEN))
                    .values(status=BatchStatus.cancelling.value, cancelling_at=now))
    session.execute(update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.queued.value)
                    .values(status=JobStatus.cancelled.value, finished_at=now, error="batch cancelled"))
    running = [str(i) for i in session.scalars(
        update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.running.value,
                          Job.cancel_requested_at.is_(None))
        .values(cancel_requested_at=now).returning(Job.id))]
    session.commit()
    if running:
        try:
            broadcast_cancel(celery, running)
        except Exception:  # each worker also finds the requests in the rows at its next heartbeat
            log.exception("could not broadcast the cancel of batch %s", batch_id)
    settle_batch(session, batch_id)
    session.commit()
    session.refresh(batch)
    return batch_out(session, batch)


@router.post("/{batch_id}/retry", response_model=BatchOut)
def retry_failed(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, settings: SettingsDep,
                 _: SubmitKey) -> BatchOut:
    """Run the batch's failed jobs again (lines that failed validation cannot run: fix and upload those)."""
    batch = _get_batch(session, batch_id)
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


def _completion(job: Job, result: Result) -> dict:
    message = {"role": "assistant", "content": result.text}
    if result.reasoning is not None:  # vLLM's reasoning parser's convention
        message["reasoning_content"] = result.reasoning
    return {
        "id": f"chatcmpl-{job.id.hex}",
        "object": "chat.completion",
        "created": _unix(result.created_at),
        "model": "convoq",
        "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason}],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                  "total_tokens": result.prompt_tokens + result.completion_tokens},
        "convoq": {"chunks": result.chunks, "levels": result.levels},
    }


def _lines(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool) -> Iterator[bytes]:
    with sessions() as session:
        batch = _get_batch(session, batch_id)
        if errors:
            for e in batch.line_errors:
                yield _line(f"batch_req_line{e['line']}", e["custom_id"], None,
                            {"code": "invalid_line", "message": f"line {e['line']}: {e['message']}"})
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
                response = {"status_code": 200, "request_id": str(job.id), "body": _completion(job, result)}
                yield _line(f"batch_req_{job.id.hex}", job.custom_id, response, None)


def _line(line_id: str, custom_id: str | None, response: dict | None, error: dict | None) -> bytes:
    return (json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error}) + "\n").encode()


@router.get("/{batch_id}/output")
def batch_output(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, _: ReadKey) -> StreamingResponse:
    """Succeeded items as OpenAI Batch output lines (available while the batch still runs)."""
    _get_batch(session, batch_id)
    return StreamingResponse(_lines(sessions, batch_id, errors=False), media_type="application/jsonl")


@router.get("/{batch_id}/errors")
def batch_errors(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, _: ReadKey) -> StreamingResponse:
    """Bad lines, failed, cancelled and expired items, as OpenAI Batch error lines (`error.code`: `invalid_line`,
    `job_failed`, `cancelled`, `expired`)."""
    _get_batch(session, batch_id)
    return StreamingResponse(_lines(sessions, batch_id, errors=True), media_type="application/jsonl")

