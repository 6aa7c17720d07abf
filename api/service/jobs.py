"""Jobs: check, admit, store and publish one; read it back as a caller may see it; cancel it; what streams
need of them."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from uuid import UUID

from celery import Celery
from fastapi import HTTPException, status
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.http.deps import Intake, sees
from api.http.raw_json import Spliced
from api.schemas.jobs import JobAccepted, JobOut, TimingsOut
from api.schemas.results import ResultOut
from api.service.stored_results import StoredResult, read_results
from broker.app import broadcast_cancel
from broker.publish import publish
from jobs.error_codes import ErrorCode, error_columns, shown_error
from jobs.schemas import JobIn
from jobs.settings import ApiKey
from jobs.status import JobStatus
from jobs.tables import Job, Result, Timing, job_row, utcnow
from jobs.tool_calls import stream_stops
from store.batch_settle import settle_batch
from store.clock import db_now

log = logging.getLogger(__name__)


class Unrunnable(HTTPException):
    """A job the model can never run: a 422 naming the field, as FastAPI's own validation errors do (OpenAI's
    routes answer a 400 with `message` instead)."""

    def __init__(self, field: str, message: str) -> None:
        loc = ["body", "messages"] if field == "messages" else ["body", "sampling", field]
        super().__init__(status.HTTP_422_UNPROCESSABLE_CONTENT, [{"loc": loc, "msg": message, "type": "value_error"}])
        self.message = f"{field}: {message}"


# A new job is stamped published as it is inserted, so a submission is one write; should its message not go out,
# `publish` takes the stamp back (and if this process dies first, the sweep finds no message and sends one).
_INSERT_PUBLISHED = insert(Job.__table__).values(published_at=db_now())


def enqueue(intake: Intake, caller: ApiKey, job_in: JobIn) -> JobAccepted:
    """Check, store and publish a job (or find the one its idempotency key names in the caller's tenant);
    raises 409, 422 or 429."""
    if problem := intake.check.problem(job_in):
        raise Unrunnable(*problem)
    with intake.sessions() as session:
        intake.admission.admit(session, caller.digest, 1)
        row = job_row(job_in, utcnow(), owner=caller.digest, tenant=caller.tenant)
        try:
            session.execute(_INSERT_PUBLISHED, row)
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
        # what a message needs of the row, without an ORM object to build and track
        publish(intake.celery, session, [SimpleNamespace(**row)], intake.settings, stamped=True,
                router=intake.router)
    return JobAccepted(id=row["id"], status=JobStatus.queued, created=True)


def load(sessions: sessionmaker[Session], job_id: UUID, caller: ApiKey) -> JobOut | None:
    """The job as `caller` may see it; None if there is none (or it is another tenant's)."""
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or not sees(caller, job.tenant):
            return None
        return _job_out(session, job, caller, session.get(Result, job_id))


def load_json(sessions: sessionmaker[Session], job_id: UUID, caller: ApiKey) -> tuple[JobStatus, bytes] | None:
    """The job as `load` gives it, as JSON, with its result's log-probabilities put in as they were stored, never
    parsed (tens of megabytes of them parsed and validated took ten times that); and its status, for a long
    poll."""
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or not sees(caller, job.tenant):
            return None
        stored = read_results(session, [job_id]).get(job_id)
        body = _job_out(session, job, caller, stored).model_dump(mode="json")
    spliced = Spliced()
    if stored is not None:
        answers = [body["result"], *(body["result"]["choices"] or [])]
        for answer, logprobs in zip(answers, stored.held, strict=True):
            answer["logprobs"] = None if logprobs is None else spliced.hold(logprobs)
    return JobStatus(job.status), b"".join(spliced.encoded(body))


def status_of(sessions: sessionmaker[Session], job_id: UUID) -> SimpleNamespace | None:
    """What a long poll of a job the caller may see looks at until it ends (`load_json` then reads it): its status
    alone, never its result."""
    found = statuses(sessions, [job_id]).get(job_id)
    return None if found is None else SimpleNamespace(status=JobStatus(found))


def _job_out(session: Session, job: Job, caller: ApiKey, result: Result | StoredResult | None) -> JobOut:
    """The job as `caller` may see it, with its result (a row, or one read by `read_results`) if it has one."""
    timing = session.get(Timing, job.id)
    out = JobOut.model_validate(job, from_attributes=True)
    out.error_code, out.error = shown_error(job.status, job.error, job.error_code)
    if job.error_code is None and job.error != out.error:  # settled before error codes: its error is the detail
        out.error_detail = job.error
    if result is not None:
        out.result = ResultOut.model_validate(result, from_attributes=True)
    if timing is not None:
        out.timings = TimingsOut.model_validate(timing)
    return out if "admin" in caller.scopes else for_tenant(out)


def for_tenant(out: JobOut) -> JobOut:
    """`out` without what is the operators' business: what names a host or a process inside the fleet (`worker`,
    `timings.engine_step`) and what raised (`error_detail`, an exception's text)."""
    out.worker = out.error_detail = None
    if out.timings is not None:
        out.timings.engine_step = None
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
            .values(status=JobStatus.cancelled.value, finished_at=now, **error_columns(ErrorCode.cancelled))
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


def stop_strings(sessions: sessionmaker[Session], job_id: UUID, caller: ApiKey) -> list[str] | None:
    """What a stream of the job holds back: what may become one of its stop strings, and its tool calls
    (`jobs.tool_calls.stream_stops`); None if there is no such job (or it is another tenant's)."""
    payload = Job.payload
    with sessions() as session:
        found = session.execute(select(Job.tenant, payload["sampling"]["stop"], payload["tools"], payload["tool_choice"])
                                .where(Job.id == job_id)).first()
    if found is None or not sees(caller, found[0]):
        return None
    return stream_stops(found[1] or [], found[2], found[3])


STATUS_ROWS = 5000  # ids per statement


def statuses(sessions: sessionmaker[Session], job_ids: list[UUID]) -> dict[UUID, str]:
    """The status of each of these jobs that still exists: what the streams' shared poll reads."""
    found: dict[UUID, str] = {}
    with sessions() as session:
        for start in range(0, len(job_ids), STATUS_ROWS):
            rows = session.execute(select(Job.id, Job.status).where(Job.id.in_(job_ids[start:start + STATUS_ROWS])))
            found.update((job_id, status) for job_id, status in rows)
    return found
