"""`/v1/jobs`: submit a job, read it back (optionally waiting for it to finish), follow it, cancel it."""

from __future__ import annotations

import asyncio
import logging
import time
from uuid import UUID

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.deps import V1_ERRORS, Caller, CeleryDep, SessionDep, SessionsDep, SettingsDep, errors, sees
from api.events import job_events
from jobs.batch_settle import settle_batch
from jobs.broker import broadcast_cancel
from jobs.publish import publish
from jobs.schemas import TERMINAL, JobAccepted, JobIn, JobOut, JobStatus, ResultOut, TimingsOut
from jobs.settings import ApiKey, Settings
from jobs.tables import Job, Result, Timing, job_row, utcnow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=V1_ERRORS)

NOT_FOUND = errors(e404="No such job (or another tenant's)")


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted,
             responses={200: {"model": JobAccepted, "description": "The idempotency key named an existing job of "
                                                                    "this tenant with the same body"},
                        **errors(e409="The idempotency key was used by this tenant with a different body",
                                 e429="Rate limited, or too many unfinished jobs (see Retry-After)")})
def submit_job(
    job_in: JobIn, request: Request, response: Response, session: SessionDep, celery: CeleryDep,
    settings: SettingsDep, caller: Caller,
) -> JobAccepted:
    accepted = enqueue(request, session, celery, settings, caller, job_in)
    if not accepted.created:
        response.status_code = status.HTTP_200_OK
    return accepted


def enqueue(request: Request, session: Session, celery, settings: Settings, caller: ApiKey,
            job_in: JobIn) -> JobAccepted:
    """Check, store and publish a job (or find the one its idempotency key names in the caller's tenant);
    raises 409, 422 or 429."""
    if problem := request.app.state.prompt_check.problem(job_in):
        field, message = problem
        loc = ["body", "messages"] if field == "messages" else ["body", "sampling", field]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": loc, "msg": message, "type": "value_error"}])
    admission = request.app.state.admission
    admission.admit(session, caller.digest, 1)
    row = job_row(job_in, utcnow(), owner=caller.digest, tenant=caller.tenant)
    try:
        session.execute(insert(Job.__table__), row)
        session.commit()  # the row exists before any message does: a lost publish is recoverable
    except IntegrityError:
        session.rollback()
        admission.give_back(caller.digest, 1)
        existing = session.scalar(select(Job).where(Job.tenant == caller.tenant,
                                                    Job.idempotency_key == job_in.idempotency_key))
        if existing is None:
            raise
        if existing.request_hash != row["request_hash"]:
            raise HTTPException(status.HTTP_409_CONFLICT, f"idempotency_key {job_in.idempotency_key!r} was used "
                                                          "for a different job; use a new key") from None
        return JobAccepted(id=existing.id, status=JobStatus(existing.status), created=False)
    job = Job(**row)
    publish(celery, session, [job], settings, stamp=request.app.state.stamps.submit)
    return JobAccepted(id=job.id, status=JobStatus.queued, created=True)


def load_job(sessions: sessionmaker[Session], job_id: UUID, caller: ApiKey) -> JobOut | None:
    """The job as `caller` may see it; None if there is none (or it is another tenant's)."""
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or not sees(caller, job.tenant):
            return None
        result = session.get(Result, job_id)
        timing = session.get(Timing, job_id)
        out = JobOut.model_validate(job, from_attributes=True)
        if result is not None:
            out.result = ResultOut.model_validate(result, from_attributes=True)
        if timing is not None:
            out.timings = TimingsOut.model_validate(timing)
        return out


@router.get("/{job_id}", response_model=JobOut, responses=NOT_FOUND)
async def get_job(
    job_id: UUID,
    sessions: SessionsDep,
    settings: SettingsDep,
    caller: Caller,
    wait: float = Query(0.0, ge=0.0, description="seconds to wait for the job to finish (long poll)"),
) -> JobOut:
    deadline = time.monotonic() + min(wait, settings.max_wait_seconds)
    delay = 0.02
    while True:
        job = await run_in_threadpool(load_job, sessions, job_id, caller)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        if job.status in TERMINAL or time.monotonic() >= deadline:
            return job
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 0.5)


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"description": "Server-Sent Events: `status`, `text` (all the text so far), then `result` "
                                    "(see the JobEvent schema)", "content": {"text/event-stream": {}}},
               **NOT_FOUND},
)
async def follow_job(job_id: UUID, request: Request, sessions: SessionsDep, caller: Caller) -> StreamingResponse:
    """Follow a job as it runs: its status changes and its text as it is generated, then its result. A client
    that connects late starts from the job's current state."""
    if await run_in_threadpool(load_job, sessions, job_id, caller) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    events = job_events(request.app.state.redis, lambda i: load_job(sessions, i, caller), job_id)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/{job_id}/cancel", response_model=JobOut,
             responses={**NOT_FOUND, **errors(e409="The job already finished (the detail names its status)")})
def cancel_job(job_id: UUID, session: SessionDep, sessions: SessionsDep, celery: CeleryDep, caller: Caller) -> JobOut:
    """Cancel a job. A queued one ends `cancelled` at once and never runs; a running one is stopped by its
    worker within an engine step and ends `cancelled` with the text it had (until then it shows
    `cancel_requested_at`). Cancelling again changes nothing."""
    job = cancel(session, sessions, celery, job_id, caller)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    if job.status in TERMINAL and job.status != JobStatus.cancelled:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job is {job.status.value}; only queued or running jobs "
                                                      "can be cancelled")
    return job


def cancel(session: Session, sessions: sessionmaker[Session], celery, job_id: UUID, caller: ApiKey) -> JobOut | None:
    """Cancel the job if it is queued or running (see `cancel_job`); the job as it is then, None if unknown
    (or another tenant's)."""
    found = session.execute(select(Job.tenant).where(Job.id == job_id)).first()
    if found is None or not sees(caller, found.tenant):
        return None
    now = utcnow()
    queued = session.execute(
        update(Job).where(Job.id == job_id, Job.status == JobStatus.queued.value)
        .values(status=JobStatus.cancelled.value, finished_at=now, error="cancelled before it ran")
        .returning(Job.batch_id)
    ).first()
    session.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.running.value,
                                      Job.cancel_requested_at.is_(None)).values(cancel_requested_at=now))
    session.commit()
    if queued is not None and queued.batch_id is not None:
        settle_batch(session, queued.batch_id)
        session.commit()
    job = load_job(sessions, job_id, caller)
    if job is not None and job.status == JobStatus.running:
        try:
            broadcast_cancel(celery, [str(job_id)])
        except Exception:  # the worker also finds the request in the row at its next heartbeat
            log.exception("could not broadcast the cancel of %s", job_id)
    return job
