"""Batches: create one, list them, read one (as OpenAI's Batch object), cancel it, retry its failed items, and
list the lines that could not become jobs."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from celery import Celery
from fastapi import HTTPException, status
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.http.admission import Admission
from api.http.deps import sees, visible
from api.http.paging import list_of, page
from api.schemas.batches import BatchLineError, BatchOut, RequestCounts
from api.schemas.chat_completion import unix
from api.schemas.lists import ListOf
from api.schemas.metadata import safe_metadata
from api.schemas.windows import window_seconds
from api.service import file_store, files
from api.service.batch_input import count_lines
from api.service.batch_output import batch_file_id
from api.service.uploads import BatchInput
from broker.affinity import Router
from broker.app import broadcast_cancel
from broker.publish import publish
from jobs.error_codes import ErrorCode, error_columns
from jobs.settings import ApiKey, Settings
from jobs.status import BATCH_SETTLED, BatchStatus, JobStatus
from jobs.tables import Batch, Job, utcnow
from jobs.tables import BatchLineError as LineErrorRow
from store.batch_settle import PENDING, settle_batch
from store.clock import db_now
from store.writes import retry_conflicts

log = logging.getLogger(__name__)

OPEN = (BatchStatus.validating.value, BatchStatus.in_progress.value)


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else unix(moment)


def _job_counts(session: Session, batch_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, int]]:
    """Each batch's jobs by status, in one query for a whole page of batches."""
    counts: dict[uuid.UUID, dict[str, int]] = {i: {} for i in batch_ids}
    for batch_id, job_status, n in session.execute(
            select(Job.batch_id, Job.status, func.count()).where(Job.batch_id.in_(batch_ids))
            .group_by(Job.batch_id, Job.status)):
        counts[batch_id][job_status] = n
    return counts


def batch_out(session: Session, batch: Batch, by_status: dict[str, int] | None = None) -> BatchOut:
    """The batch as OpenAI's Batch object, its request counts read from its jobs (or given, for a page)."""
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
        request_counts=counts, metadata=safe_metadata(batch.metadata_),
        completion_window=batch.completion_window, created_at=_unix(batch.created_at),
        expires_at=_unix(batch.expires_at), in_progress_at=_unix(batch.in_progress_at),
        finalizing_at=_unix(batch.finalizing_at), completed_at=_unix(batch.completed_at),
        cancelling_at=_unix(batch.cancelling_at), cancelled_at=_unix(batch.cancelled_at),
        failed_at=_unix(batch.failed_at), expired_at=_unix(batch.expired_at),
    )


def visible_batch(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> Batch:
    """The batch, or 404 when there is none or it is another tenant's (its existence is not revealed)."""
    batch = session.get(Batch, batch_id)
    if batch is None or not sees(caller, batch.tenant):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no batch {batch_id}")
    return batch


def create(sessions: sessionmaker[Session], settings: Settings, admission: Admission, caller: ApiKey,
           given: BatchInput, priority: int) -> tuple[BatchOut, uuid.UUID]:
    """Store the batch, `validating`, once its lines pass the bounds on unfinished jobs (else 429), with its lines
    in a stored file (a multipart upload is stored now, a chunk at a time) and under a new ingest lease: the batch
    and the lease, for the caller to start its ingest with (`batch_ingest.Ingests.submit`). 400, 404 or 413 as
    the input deserves."""
    with sessions() as session:
        if given.upload is not None:
            source, lines = file_store.keep(session, caller, files.UPLOAD_PURPOSE, given.name, given.upload, settings,
                                            max_lines=settings.max_batch_lines)
        else:
            source = files.batch_input_file(session, given.input_file_id, caller)
            lines = count_lines(file_store.pieces(session, source.id), settings.max_request_bytes,
                                stop_after=settings.max_batch_lines)
            if lines > settings.max_batch_lines:
                raise HTTPException(status.HTTP_400_BAD_REQUEST,
                                    f"file {source.id} has more lines than a batch takes (at most "
                                    f"{settings.max_batch_lines}): split it into several files")
        admission.admit(session, caller.digest, lines)
        window = timedelta(seconds=window_seconds(given.completion_window))
        now = utcnow()
        lease = uuid.uuid4()
        batch = Batch(priority=priority, input_name=source.filename, input_file_id=given.input_file_id,
                      tenant=caller.tenant, owner=caller.digest, status=BatchStatus.validating.value, total=0,
                      invalid_lines=0, metadata_=given.metadata, completion_window=given.completion_window,
                      created_at=now, expires_at=now + window, source_file_id=source.id, ingest_lease_id=lease,
                      ingest_lease_expires_at=db_now(settings.dead_after_s))
        session.add(batch)
        session.commit()
        return batch_out(session, batch), lease


def list_page(session: Session, caller: ApiKey, after: uuid.UUID | None, limit: int) -> ListOf[BatchOut]:
    """The caller's batches, newest first, a page after `after` (404 when it names none of them)."""
    batches, more = page(session, visible(select(Batch), Batch, caller), Batch, after, limit)
    counts = _job_counts(session, [b.id for b in batches])
    return list_of([batch_out(session, b, counts[b.id]) for b in batches], more)


def get(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> BatchOut:
    batch = visible_batch(session, batch_id, caller)
    if batch.status in (BatchStatus.in_progress.value, BatchStatus.cancelling.value):
        settle_batch(session, batch_id)  # a safety net: workers settle batches too
        session.commit()
        session.refresh(batch)
    return batch_out(session, batch)


def cancel(session: Session, celery: Celery, batch_id: uuid.UUID, caller: ApiKey) -> BatchOut:
    """Cancel the queued items, ask the running ones to stop; 409 once the batch is no longer open."""
    batch = visible_batch(session, batch_id, caller)
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
                    .values(status=JobStatus.cancelled.value, finished_at=now,
                            **error_columns(ErrorCode.cancelled, "its batch was cancelled before it ran")))
    running = [str(i) for i in session.scalars(
        update(Job).where(Job.batch_id == batch_id, Job.status == JobStatus.running.value,
                          Job.cancel_requested_at.is_(None))
        .values(cancel_requested_at=now).returning(Job.id))]
    session.commit()
    return running


# what a retried job's row is reset to: a fresh run (a claim fails a job past its attempts, and crashes make it a
# suspect run alone, or fail it), stamped published as it is written (`publish` takes the stamp back if its message
# does not go out)
_FRESH_RUN = dict(status=JobStatus.queued.value, error=None, error_code=None, error_detail=None, started_at=None,
                  finished_at=None, attempts=0, crashes=0, alone_at=None, worker=None, lease_id=None,
                  lease_expires_at=None, message_missing_at=None, cancel_requested_at=None)


def retry_failed(session: Session, celery: Celery, settings: Settings, admission: Admission, batch_id: uuid.UUID,
                 caller: ApiKey, router: Router | None = None) -> BatchOut:
    """Queue the batch's failed jobs again and publish them; 409 while it is validating or cancelling, 429 (and
    nothing changed) when they would pass a bound on unfinished jobs. Only jobs still `failed` when they are
    written are reset: of two retries at once, the second finds none, and a job the first already queued (or a
    worker took since) is never reset under it."""
    batch = visible_batch(session, batch_id, caller)
    if batch.status in (BatchStatus.validating.value, BatchStatus.cancelling.value):
        raise HTTPException(status.HTTP_409_CONFLICT, f"batch is {batch.status}; retry once it settles")
    failed = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id,
                                                       Job.status == JobStatus.failed.value)))
    if not failed:
        return batch_out(session, batch)
    admission.admit(session, caller.digest, len(failed))
    jobs = session.execute(
        update(Job).where(Job.id.in_(failed), Job.status == JobStatus.failed.value)
        .values(published_at=db_now(), **_FRESH_RUN)
        .returning(Job.id, Job.kind, Job.priority, Job.tenant, Job.conversation_id, Job.batch_id)).all()
    admission.give_back(caller.digest, len(failed) - len(jobs))  # taken meanwhile by another retry
    if jobs:
        session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.not_in(
            (BatchStatus.validating.value, BatchStatus.cancelling.value)))
            .values(status=BatchStatus.in_progress.value, completed_at=None, finalizing_at=None,
                    in_progress_at=func.coalesce(Batch.in_progress_at, utcnow())))
    session.commit()
    if jobs:
        publish(celery, session, jobs, settings, stamped=True, router=router)
    session.refresh(batch)
    return batch_out(session, batch)


def line_errors(session: Session, batch_id: uuid.UUID, caller: ApiKey, after: int | None,
                limit: int) -> ListOf[BatchLineError]:
    """The batch's bad lines numbered past `after` (None: from line 0, the batch's own error), at most `limit`."""
    visible_batch(session, batch_id, caller)
    after = -1 if after is None else after
    rows = list(session.scalars(select(LineErrorRow).where(LineErrorRow.batch_id == batch_id, LineErrorRow.line > after)
                                .order_by(LineErrorRow.line).limit(limit + 1)))
    found = [BatchLineError(line=r.line, custom_id=r.custom_id, message=r.message) for r in rows[:limit]]
    return ListOf(data=found, first_id=str(found[0].line) if found else None,
                  last_id=str(found[-1].line) if found else None, has_more=len(rows) > limit)
