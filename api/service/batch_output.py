"""A batch's output and error lines (OpenAI Batch output format), read from its jobs, and their file ids.

They are files too (OpenAI's `output_file_id`, `error_file_id`): nothing is stored, their ids name the batch
and their content is read from its jobs on each download. A download reads a page at a time (a keyset: the
page after the last line number or `custom_id` sent), each page one short transaction that ends before its
lines go out, so a client that reads slowly holds no database connection while it reads. A page is bounded in
bytes, not only in rows: one line with `n` 8, `top_logprobs` 20 and 4,096 tokens holds ~30 MB of
log-probabilities, so a page takes lines while their stored bytes (measured by PostgreSQL, `STORED_BYTES`) fit in
`PAGE_BYTES`, and at least one. The log-probabilities go out as the JSON text stored (`api.http.raw_json`), never
parsed, and a file's size is summed from their lengths without reading them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from sqlalchemy import Text, cast, func, select
from sqlalchemy.orm import Session, sessionmaker

from api.http.raw_json import Spliced
from api.schemas.chat_completion import chat_completion, unix
from api.schemas.results import ResultOut
from api.service.stored_results import StoredResult, byte_length, read_results
from jobs.error_codes import shown_error
from jobs.status import JobStatus
from jobs.tables import BatchLineError, Job, Result

BATCH_FILE = re.compile(r"file-([0-9a-f]{32})-(output|errors)")
ERROR_ROWS = 1000  # line-error rows read per round trip (each message at most 2,000 characters)
JOB_ROWS = 500  # jobs looked at per round trip
PAGE_BYTES = 4 * 2**20  # stored bytes of a page's results: a few lines of long log-probabilities are a page
# what a line's size follows: its result's text, reasoning, tool calls and log-probabilities as stored (PostgreSQL
# measures them where they are), or its error
STORED_BYTES = sum(func.coalesce(byte_length(column), 0) for column in (
    Result.text, Result.reasoning, cast(Result.tool_calls, Text), cast(Result.logprobs, Text),
    cast(Result.choices, Text), Job.error))
Key = TypeVar("Key")
Line = tuple[Spliced, dict]  # a line's object, and the stored values held out of it


def batch_file_id(batch_id: uuid.UUID, errors: bool) -> str:
    return f"file-{batch_id.hex}-{'errors' if errors else 'output'}"


def parse_batch_file_id(file_id: str) -> tuple[uuid.UUID, bool] | None:
    """(batch id, whether it is the error file) for a batch's output or error file id; None for any other id."""
    match = BATCH_FILE.fullmatch(file_id)
    return None if match is None else (uuid.UUID(match[1]), match[2] == "errors")


def completion(job: Job, result: Result | StoredResult, model: str) -> dict:
    """A succeeded item's `response.body`: a `chat.completion`, plus how it was chunked."""
    body = chat_completion(f"chatcmpl-{job.id.hex}", unix(result.created_at), model,
                           ResultOut.model_validate(result, from_attributes=True))
    return {**body, "convoq": {"chunks": result.chunks, "levels": result.levels}}


def lines(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str) -> Iterator[bytes]:
    """The batch's output lines (succeeded items) or error lines (bad lines; failed, cancelled, expired items), a
    piece at a time: a line's log-probabilities go out as they were stored. The caller has checked that the batch
    is there for whoever asked."""
    for spliced, line in _lines(sessions, batch_id, errors, model, lengths_only=False):
        pieces = list(spliced.encoded(line))
        yield from pieces[:-1]
        yield pieces[-1] + b"\n"  # the text after the last value held: a few bytes


def size(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str) -> int:
    """The bytes `lines` would give, from the lengths of the log-probabilities (never read here) and the rest of
    each line."""
    return sum(spliced.size(line) + 1 for spliced, line in _lines(sessions, batch_id, errors, model,
                                                                   lengths_only=True))


def _lines(sessions: sessionmaker[Session], batch_id: uuid.UUID, errors: bool, model: str,
           lengths_only: bool) -> Iterator[Line]:
    if errors:
        def line_errors(session: Session, after: int) -> tuple[list[tuple[int, Line]], bool]:
            rows = list(session.scalars(select(BatchLineError).where(BatchLineError.batch_id == batch_id,
                                                                     BatchLineError.line > after)
                                        .order_by(BatchLineError.line).limit(ERROR_ROWS)))
            return [(e.line, (Spliced(), _line(f"batch_req_line{e.line}", e.custom_id, None, {
                "code": "invalid_line", "message": f"line {e.line}: {e.message}"}))) for e in rows], \
                len(rows) == ERROR_ROWS

        yield from _pages(sessions, line_errors, -1)  # line 0: the batch's own error (its ingest failed)
        wanted = (JobStatus.failed.value, JobStatus.cancelled.value, JobStatus.expired.value)
    else:
        wanted = (JobStatus.succeeded.value,)
    mine = (Job.batch_id == batch_id) & Job.status.in_(wanted)

    def items(session: Session, after: str) -> tuple[list[tuple[str, Line]], bool]:
        # custom_id is unique in its batch (and never null there): the keyset runs on its unique index
        sizes = session.execute(select(Job.custom_id, STORED_BYTES).outerjoin(Result, Result.job_id == Job.id)
                                .where(mine, Job.custom_id > after).order_by(Job.custom_id).limit(JOB_ROWS)).all()
        if not sizes:
            return [], False
        taken = within(sizes)
        jobs = session.execute(select(Job.id, Job.custom_id, Job.status, Job.error, Job.error_code)
                               .where(mine, Job.custom_id > after, Job.custom_id <= sizes[taken - 1].custom_id)
                               .order_by(Job.custom_id)).all()
        stored = {} if errors else read_results(session, [job.id for job in jobs], lengths_only)
        # a succeeded job always has its result, unless a retention sweep deleted both since the read
        page = [(job.custom_id, _item_line(job, stored.get(job.id), errors, model)) for job in jobs
                if errors or job.id in stored]
        return page, taken < len(sizes) or len(sizes) == JOB_ROWS

    yield from _pages(sessions, items, "")


def within(sizes: list) -> int:
    """How many of the lines (each a row ending in its stored bytes) make a page: as many as fit in `PAGE_BYTES`,
    and at least one however large."""
    total = 0
    for n, row in enumerate(sizes):
        total += row[-1]
        if total > PAGE_BYTES and n > 0:
            return n
    return len(sizes)


def _pages(sessions: sessionmaker[Session], read: Callable[[Session, Key], tuple[list[tuple[Key, Line]], bool]],
           start: Key) -> Iterator[Line]:
    """The lines of every page `read` gives (each with its key, and whether more may follow), the next one after
    the last key of the one before; each read in a session of its own, closed before its lines are handed out."""
    after = start
    while True:
        with sessions() as session:
            page, more = read(session, after)
        yield from (line for _, line in page)
        if not more or not page:
            return
        after = page[-1][0]


def _item_line(job, stored: StoredResult | None, errors: bool, model: str) -> Line:
    spliced = Spliced()
    if errors:
        code, message = shown_error(job.status, job.error, job.error_code)
        return spliced, _line(f"batch_req_{job.id.hex}", job.custom_id, None, {"code": code, "message": message})
    body = completion(job, stored, model)
    for answer, logprobs in zip(body["choices"], stored.held, strict=True):
        if logprobs is not None:
            answer["logprobs"] = {"content": spliced.hold(logprobs), "refusal": None}
    response = {"status_code": 200, "request_id": str(job.id), "body": body}
    return spliced, _line(f"batch_req_{job.id.hex}", job.custom_id, response, None)


def _line(line_id: str, custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": error}
