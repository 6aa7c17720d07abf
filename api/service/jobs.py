"""Jobs: check, admit, store and publish one; read it back as a caller may see it; cancel it."""

from __future__ import annotations

import logging
from uuid import UUID

from celery import Celery
from fastapi import HTTPException, status
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.deps import Intake, sees
from jobs.batch_settle import settle_batch
from jobs.broker import broadcast_cancel
from jobs.publish import publish
from jobs.schemas import JobAccepted, JobIn, JobOut, JobStatus, ResultOut, TimingsOut
from jobs.settings import ApiKey, Settings
from jobs.tables import Job, Result, Timing, job_row, utcnow

log = logging.getLogger(__name__)


def enqueue(sessions: sessionmaker[Session], celery: Celery, settings: Settings, intake: Intake, caller: ApiKey,
            job_in: JobIn) -> JobAccepted:
    """Check, store and publish a job (or find the one its idempotency key names in the caller's tenant);
    raises 409, 422 or 429."""
    if problem := intake.check.problem(job_in):
        field, message = problem
        loc = ["body", "messages"] if field == "messages" else ["body", "sampling", field]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": loc, "msg": message, "type": "value_error"}])
    with sessions() as session:
        intake.admission.admit(session, caller.digest, 1)
        row = job_row(job_in, utcnow(), owner=caller.digest, tenant=caller.tenant)
        try:
            session.execute(insert(Job.__table__), row)
            session.commit()  # the row exists before any message does: a lost publish is recoverable
        except IntegrityError:
            session.rollback()
            intake.admission.give_back(caller.digest, 1)
            existing = session.scalar(select(Job).where(Job.tenant == caller.tenant,
                                                        Job.idempotency_key == job_in.idempotency_key))
            if existing is None:
                raise
            if existing.request_hash != row["request_hash"]:
                raise HTTPException(status.HTTP_409_CONFLICT, f"idempotency_key {job_in.idempotency_key!r} was "
                                                              "used for a different job; use a new key") from None
            return JobAccepted(id=existing.id, status=JobStatus(existing.status), created=False)
        job = Job(**row)
        publish(celery, session, [job], settings, stamp=intake.stamp)
    return JobAccepted(id=job.id, status=JobStatus.queued, created=True)


def load(sessions: sessionmaker[Session], job_id: UUID, caller: ApiKey) -> JobOut | None:
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


def cancel(sessions: sessionmaker[Session], celery: Celery, job_id: UUID, caller: ApiKey) -> JobOut | None:
    """Cancel the job if it is queued or running: a queued one ends `cancelled` at once, a running one is asked
    to stop. The job as it is then (finished ones unchanged), None if unknown (or another tenant's)."""
    with sessions() as session:
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
    job = load(sessions, job_id, caller)
    if job is not None and job.status == JobStatus.running:
        try:
            broadcast_cancel(celery, [str(job_id)])
        except Exception:  # the worker also finds the request in the row at its next heartbeat
            log.exception("could not broadcast the cancel of %s", job_id)
    return job
