"""`/v1/batches`: bulk uploads in the OpenAI Batch format (or ours), their progress, results and errors."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.http.deps import (
    JSONL,
    JSONL_TYPE,
    V1_ERRORS,
    Caller,
    CeleryDep,
    IntakeDep,
    SessionDep,
    SessionsDep,
    SettingsDep,
    errors,
)
from api.http.priority import BatchPriorityHeader, chosen_priority
from api.schemas.batches import BatchLineError, BatchOut
from api.schemas.lists import ListOf
from api.service import batches, uploads
from api.service.batch_output import lines as batch_lines
from jobs.priority import DEFAULT_BATCH_PRIORITY

router = APIRouter(prefix="/v1/batches", tags=["batches"], responses=V1_ERRORS)

NOT_FOUND = errors(e404="No such batch (or another tenant's)")


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=BatchOut,
             openapi_extra=uploads.request_bodies(),
             responses=errors(
                 e400="An input file that is not a batch input, or has more than CONVOQ_MAX_BATCH_LINES lines",
                 e404="No file input_file_id (or another tenant's)",
                 e413="The upload is larger than CONVOQ_MAX_UPLOAD_BYTES or has more than CONVOQ_MAX_BATCH_LINES lines "
                      "(a JSON body: larger than CONVOQ_MAX_REQUEST_BYTES)",
                 e415="Neither application/json nor multipart/form-data",
                 e429="Rate limited, or its lines would pass the bound on unfinished jobs (see Retry-After)"))
async def create_batch(
    request: Request,
    sessions: SessionsDep,
    settings: SettingsDep,
    intake: IntakeDep,
    caller: Caller,
    x_convoq_priority: BatchPriorityHeader = None,
) -> BatchOut:
    """Create a batch from OpenAI's JSON body (`input_file_id`: a file uploaded with purpose `batch`, as the
    `openai` SDK sends it) or from a multipart/form-data upload of the JSONL itself (`file`, as our client and
    CLI send it). The lines are checked and run after the answer, by this API process or, should it stop first,
    by another; bad lines are listed at `GET /v1/batches/{id}/line_errors`."""
    async with uploads.batch_input(request, settings) as given:  # the body is read here, on the event loop
        priority = chosen_priority(x_convoq_priority, given.priority, DEFAULT_BATCH_PRIORITY)
        # storing the upload, admission and the commit wait on the database: never on the event loop
        batch, lease = await run_in_threadpool(batches.create, sessions, settings, intake.admission, caller, given,
                                               priority)
    intake.ingest(batch.id, lease)
    return batch


@router.get("", response_model=ListOf[BatchOut], responses=errors(e404="`after` names no batch of this tenant"))
def list_batches(
    session: SessionDep,
    caller: Caller,
    after: Annotated[uuid.UUID | None, Query(description="the last id of the page before")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListOf[BatchOut]:
    """Batches, newest first, in OpenAI's list object."""
    return batches.list_page(session, caller, after, limit)


@router.get("/{batch_id}", response_model=BatchOut, responses=NOT_FOUND)
def get_batch(batch_id: uuid.UUID, session: SessionDep, caller: Caller) -> BatchOut:
    return batches.get(session, batch_id, caller)


@router.post("/{batch_id}/cancel", response_model=BatchOut,
             responses={**NOT_FOUND, **errors(e409="The batch is no longer open (the detail names its status)")})
def cancel_batch(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, caller: Caller) -> BatchOut:
    """Queued items are cancelled and never run; running ones are stopped by their workers and end `cancelled`
    with the text they had. Finished items stay downloadable."""
    return batches.cancel(session, celery, batch_id, caller)


@router.post("/{batch_id}/retry", response_model=BatchOut,
             responses={**NOT_FOUND, **errors(e409="The batch is validating or cancelling; retry once it settles",
                                              e429="Rate limited, or its failed items would pass the bound on "
                                                   "unfinished jobs (see Retry-After)")})
def retry_failed(batch_id: uuid.UUID, session: SessionDep, celery: CeleryDep, settings: SettingsDep,
                 intake: IntakeDep, caller: Caller) -> BatchOut:
    """Run the batch's failed jobs again (lines that failed validation cannot run: fix and upload those). They
    count against the bounds on unfinished jobs as new work does."""
    return batches.retry_failed(session, celery, settings, intake.admission, batch_id, caller, intake.router)


@router.get("/{batch_id}/output", response_class=StreamingResponse, responses={**JSONL, **NOT_FOUND})
def batch_output(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> StreamingResponse:
    """Succeeded items as OpenAI Batch output lines (available while the batch still runs)."""
    batches.visible_batch(session, batch_id, caller)
    return StreamingResponse(batch_lines(sessions, batch_id, False, settings.model), media_type=JSONL_TYPE)


@router.get("/{batch_id}/errors", response_class=StreamingResponse, responses={**JSONL, **NOT_FOUND})
def batch_errors(batch_id: uuid.UUID, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> StreamingResponse:
    """Bad lines, failed, cancelled and expired items, as OpenAI Batch error lines (`error.code`: `invalid_line`,
    `job_failed`, `cancelled`, `expired`)."""
    batches.visible_batch(session, batch_id, caller)
    return StreamingResponse(batch_lines(sessions, batch_id, True, settings.model), media_type=JSONL_TYPE)


@router.get("/{batch_id}/line_errors", response_model=ListOf[BatchLineError], responses=NOT_FOUND)
def line_errors(
    batch_id: uuid.UUID,
    session: SessionDep,
    caller: Caller,
    after: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="the last line number of the page before "
                                                                      "(none: from the first, line 0 being the "
                                                                      "batch's own, an ingest that failed)")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ListOf[BatchLineError]:
    """The lines that could not become jobs, by line number, a page at a time (`request_counts.invalid` counts
    them)."""
    return batches.line_errors(session, batch_id, caller, after, limit)
