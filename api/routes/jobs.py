"""`/v1/jobs`: submit a job, read it back (optionally waiting for it to finish), follow it, cancel it."""

from __future__ import annotations

from uuid import UUID

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.http.deps import V1_ERRORS, Caller, CeleryDep, HubDep, IntakeDep, SessionsDep, SettingsDep, errors
from api.http.json_body import BoundedJsonRoute
from api.schemas.jobs import JobAccepted, JobOut
from api.service.jobs import cancel, enqueue, load, load_json, status_of, stop_strings
from api.streams.events import EventStream, job_events, wait_finished
from jobs.schemas import JobIn
from jobs.status import TERMINAL, JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=V1_ERRORS, route_class=BoundedJsonRoute)

NOT_FOUND = errors(e404="No such job (or another tenant's)")


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobAccepted,
             responses={200: {"model": JobAccepted, "description": "The idempotency key named an existing job of "
                                                                    "this tenant with the same body"},
                        **errors(e409="The idempotency key was used by this tenant with a different body",
                                 e429="Rate limited, or too many unfinished jobs (see Retry-After)")})
def submit_job(job_in: JobIn, intake: IntakeDep, caller: Caller) -> Response:
    accepted = enqueue(intake, caller, job_in)
    # serialized once, here: returned as a model, it would be validated against `response_model` first
    return Response(accepted.model_dump_json(), media_type="application/json",
                    status_code=status.HTTP_202_ACCEPTED if accepted.created else status.HTTP_200_OK)


@router.get("/{job_id}", response_model=JobOut, responses=NOT_FOUND)
async def get_job(
    job_id: UUID,
    sessions: SessionsDep,
    settings: SettingsDep,
    hub: HubDep,
    caller: Caller,
    wait: float = Query(0.0, ge=0.0, description="seconds to wait for the job to finish (long poll)"),
) -> Response:
    # serialized here, its result's log-probabilities as stored (`load_json`): as a model, tens of megabytes of
    # them would be parsed, validated and dumped again
    found = await run_in_threadpool(load_json, sessions, job_id, caller)
    if found is not None and found[0] not in TERMINAL and wait > 0:
        release = hub.admit(caller.digest)  # a long poll holds a subscription as a stream does, within its bounds
        try:
            await wait_finished(hub, lambda i: status_of(sessions, i), job_id, min(wait, settings.max_wait_seconds))
        finally:
            release()
        found = await run_in_threadpool(load_json, sessions, job_id, caller)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return Response(found[1], media_type="application/json")


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"description": "Server-Sent Events: `status`, `text` (all the text so far), then `result`, "
                                    "or `error` when the job ran again and its text restarted (see the JobEvent "
                                    "schema)", "content": {"text/event-stream": {}}},
               **NOT_FOUND,
               **errors(e429="Rate limited, or too many streams of this key or of this process "
                             "(CONVOQ_MAX_STREAMS_PER_KEY, CONVOQ_MAX_STREAMS; see Retry-After)")},
)
async def follow_job(job_id: UUID, sessions: SessionsDep, hub: HubDep, caller: Caller) -> StreamingResponse:
    """Follow a job as it runs: its status changes and its text as it is generated, then its result. A client
    that connects late starts from the job's current state. Each text event goes on from the one before and
    from what the job stores; a job run again (after its worker was lost) whose new text does not ends the
    stream with an `error` event: read the job then."""
    stops = await run_in_threadpool(stop_strings, sessions, job_id, caller)
    if stops is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    release = hub.admit(caller.digest)
    return EventStream(job_events(hub, lambda i: load(sessions, i, caller), job_id, stops), release)


@router.post("/{job_id}/cancel", response_model=JobOut,
             responses={**NOT_FOUND, **errors(e409="The job already finished (the detail names its status)")})
def cancel_job(job_id: UUID, sessions: SessionsDep, celery: CeleryDep, caller: Caller) -> JobOut:
    """Cancel a job. A queued one ends `cancelled` at once and never runs; a running one is stopped by its
    worker within an engine step and ends `cancelled` with the text it had (until then it shows
    `cancel_requested_at`). Cancelling again changes nothing."""
    job = cancel(sessions, celery, job_id, caller)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    if job.status in TERMINAL and job.status != JobStatus.cancelled:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job is {job.status.value}; only queued or running jobs "
                                                      "can be cancelled")
    return job
