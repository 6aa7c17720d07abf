"""A batch's output and error lines (OpenAI Batch output format), read from its jobs, and their file ids.

They are files too (OpenAI's `output_file_id`, `error_file_id`): nothing is stored, their ids name the batch
and their content is read from its jobs on each download. A download reads a page at a time (a keyset: the
page after the last line number or `custom_id` sent), each page one short transaction that ends before its
lines go out, so a client that reads slowly holds no database connection while it reads.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.openai_objects import chat_completion, unix
from jobs.schemas import JobStatus, ResultOut, shown_error
from jobs.tables import BatchLineError, Job, Result

BATCH_FILE = re.compile(r"file-([0-9a-f]{32})-(output|errors)")
ERROR_ROWS = 1000  # line-error rows read per round trip
JOB_ROWS = 500  # jobs (with their results) read per round trip
Key = TypeVar("Key")


def batch_file_id(batch_id: uuid.UUID, errors: bool) -> str:
    return f"file-{batch_id.hex}-{'errors' if errors else 'output'}"


def parse_batch_file_id(file_id: str) -> tuple[uuid.UUID, bool] | None:
    """(batch id, whether it is the error file) for a batch's output or error file id; None for any other id."""
    match = BATCH_FILE.fullmatch(file_id)
    return None if match is None else (uuid.UUID(match[1]), match[2] == "errors")


def completion(job: Job, result: Result, model: str) -> dict:
    """A succeeded item's `response.body`: a `chat.completion`, plus how it was chunked."""
    body = chat_completion(f"chatcmpl-{job.id.hex}", unix(result.created_at), model,
                           ResultOut.model_validate(result, from_attributes=True))
    return {**body, "convoq": {"chunks": result.chunks, "levels": result.levels}}


def lines(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str) -> Iterator[bytes]:
    """The batch's output lines (succeeded items) or error lines (bad lines; failed, cancelled, expired items).
    The caller has checked that the batch is there for whoever asked."""
    if errors:
        def line_errors(session: Session, after: int) -> list[tuple[int, bytes]]:
            rows = session.scalars(select(BatchLineError).where(BatchLineError.batch_id == batch_id,
                                                                BatchLineError.line > after)
                                   .order_by(BatchLineError.line).limit(ERROR_ROWS))
            return [(e.line, _line(f"batch_req_line{e.line}", e.custom_id, None,
                                   {"code": "invalid_line", "message": f"line {e.line}: {e.message}"}))
                    for e in rows]

        yield from _pages(sessions, line_errors, 0, ERROR_ROWS)
        wanted = (JobStatus.failed.value, JobStatus.cancelled.value, JobStatus.expired.value)
    else:
        wanted = (JobStatus.succeeded.value,)

    def items(session: Session, after: str) -> list[tuple[str, bytes]]:
        # custom_id is unique in its batch (and never null there): the keyset runs on its unique index
        rows = session.execute(
            select(Job, Result).outerjoin(Result, Result.job_id == Job.id)
            .where(Job.batch_id == batch_id, Job.custom_id > after, Job.status.in_(wanted))
            .order_by(Job.custom_id).limit(JOB_ROWS))
        return [(job.custom_id, _item_line(job, result, errors, model)) for job, result in rows]

    yield from _pages(sessions, items, "", JOB_ROWS)


def _pages(sessions: sessionmaker[Session], read: Callable[[Session, Key], list[tuple[Key, bytes]]], start: Key,
           size: int) -> Iterator[bytes]:
    """The lines of every page `read` gives (each with its key), the next one after the last key of the one
    before; each read in a session of its own, closed before its lines are handed out."""
    after = start
    while True:
        with sessions() as session:
            page = read(session, after)
        yield from (line for _, line in page)
        if len(page) < size:
            return
        after = page[-1][0]


def _item_line(job: Job, result: Result | None, errors: bool, model: str) -> bytes:
    if errors:  # the error its tenant is shown: a stable message and its code (`jobs.schemas.ErrorCode`)
        code, message = shown_error(job.status, job.error, job.error_code)
        return _line(f"batch_req_{job.id.hex}", job.custom_id, None, {"code": code, "message": message})
    response = {"status_code": 200, "request_id": str(job.id), "body": completion(job, result, model)}
    return _line(f"batch_req_{job.id.hex}", job.custom_id, response, None)


def _line(line_id: str, custom_id: str | None, response: dict | None, error: dict | None) -> bytes:
    return (json.dumps({"id": line_id, "custom_id": custom_id, "response": response, "error": error}) + "\n").encode()
