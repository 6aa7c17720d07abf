"""`/v1/jobs`: submit a job, read it back (optionally waiting for it to finish)."""

from __future__ import annotations

import asyncio
import time
from uuid import UUID

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.deps import CeleryDep, ReadKey, SessionDep, SessionsDep, SettingsDep, SubmitKey
from jobs.publish import publish
from jobs.schemas import TERMINAL, JobAccepted, JobIn, JobOut, JobStatus, ResultOut, TimingsOut
from jobs.tables import Job, Result, Timing, job_row

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted)
def submit_job(
    job_in: JobIn, request: Request, response: Response, session: SessionDep, celery: CeleryDep,
    settings: SettingsDep, _: SubmitKey,
) -> JobAccepted:
    if problem := request.app.state.prompt_check.problem(job_in):
        field, message = problem
        loc = ["body", "messages"] if field == "messages" else ["body", "sampling", field]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": loc, "msg": message, "type": "value_error"}])
    row = job_row(job_in)
    try:
        session.execute(insert(Job.__table__), row)
        session.commit()  # the row exists before any message does: a lost publish is recoverable
    except IntegrityError:
        session.rollback()
        existing = session.scalar(select(Job).where(Job.idempotency_key == job_in.idempotency_key))
        if existing is None:
            raise
        response.status_code = status.HTTP_200_OK
        return JobAccepted(id=existing.id, status=JobStatus(existing.status), created=False)
    job = Job(**row)
    publish(celery, session, [job], settings, stamp=request.app.state.stamps.submit)
    return JobAccepted(id=job.id, status=JobStatus.queued, created=True)


def load_job(sessions: sessionmaker[Session], job_id: UUID) -> JobOut | None:
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None:
            return None
        result = session.get(Result, job_id)
        timing = session.get(Timing, job_id)
        out = JobOut.model_validate(job, from_attributes=True)
        if result is not None:
            out.result = ResultOut.model_validate(result, from_attributes=True)
        if timing is not None:
            out.timings = TimingsOut.model_validate(timing)
        return out


@router.get("/{job_id}", response_model=JobOut)
async def get_job(
    job_id: UUID,
    sessions: SessionsDep,
    settings: SettingsDep,
    _: ReadKey,
    wait: float = Query(0.0, ge=0.0, description="seconds to wait for the job to finish (long poll)"),
) -> JobOut:
    deadline = time.monotonic() + min(wait, settings.max_wait_seconds)
    delay = 0.02
    while True:
        job = await run_in_threadpool(load_job, sessions, job_id)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        if job.status in TERMINAL or time.monotonic() >= deadline:
            return job
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 0.5)
