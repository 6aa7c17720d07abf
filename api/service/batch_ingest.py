"""A new batch's lines becoming jobs: validated one at a time, stored a thousand at a time, then published.

`ingest` needs only the batch's id and its lines (a spooled upload or a stored file's bytes), never the
request that brought them, so it runs after the answer and could as well resume from what is stored.
"""

from __future__ import annotations

import logging
import uuid
from typing import IO

from celery import Celery
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.batch_input import LineError, ParsedLine, parse_lines
from api.prompt_check import PromptCheck
from jobs.publish import publish
from jobs.schemas import BatchStatus
from jobs.settings import Settings
from jobs.tables import Batch, BatchLineError, Job, job_row, utcnow

log = logging.getLogger(__name__)

INSERT_ROWS = 1000  # job and line-error rows per INSERT


def ingest(sessions: sessionmaker[Session], celery: Celery, settings: Settings, check: PromptCheck,
           batch_id: uuid.UUID, source: IO[bytes], owner: str) -> None:
    """Validate the lines of `source` one by one, create one job per good line (owned by `owner`, the hash of
    the key that sent the batch), publish them; `source` is closed at the end. Lines are read, checked and
    inserted a thousand at a time, so memory holds one chunk, never the upload."""
    try:
        with sessions() as session:
            batch = session.get(Batch, batch_id)
            try:
                total, invalid = _store_lines(session, batch, check, source, owner)
            except Exception as exc:
                session.rollback()
                log.exception("batch %s could not be ingested", batch_id)
                session.execute(insert(BatchLineError.__table__), {
                    "batch_id": batch_id, "line": 0, "custom_id": None,
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
                 owner: str) -> tuple[int, int]:
    """Insert a job per good line and a `BatchLineError` per bad one (uncommitted); (lines, bad lines)."""
    jobs: list[dict] = []
    bad: list[dict] = []
    total = invalid = 0
    now = utcnow()

    def flush() -> None:
        if jobs:
            session.execute(insert(Job.__table__), jobs)  # one statement run for every row
        if bad:
            session.execute(insert(BatchLineError.__table__), bad)
        jobs.clear()
        bad.clear()

    for item in parse_lines(source, batch.priority):
        total += 1
        if isinstance(item, ParsedLine) and (problem := check.problem(item.job)):
            item = LineError(item.line, item.custom_id, f"{problem[0]}: {problem[1]}")
        if isinstance(item, ParsedLine):
            jobs.append(job_row(item.job, now, deadline_at=batch.expires_at, batch_id=batch.id,
                                custom_id=item.custom_id, owner=owner, tenant=batch.tenant))
        else:
            invalid += 1
            bad.append({"batch_id": batch.id, "line": item.line, "custom_id": item.custom_id,
                        "message": item.message})
        if len(jobs) + len(bad) >= INSERT_ROWS:
            flush()
    flush()
    return total, invalid
