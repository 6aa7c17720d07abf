"""Files (OpenAI's Files API, for batches): uploads kept in the database (`file_store`, a chunk per row), and
each batch's output and error files, which are read from its jobs (`batch_output`) and cannot be deleted."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import IO

from fastapi import HTTPException, status
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from api.http.deps import sees, visible
from api.http.paging import list_of, page
from api.schemas.chat_completion import unix
from api.schemas.files import FileDeleted, FileOut
from api.schemas.lists import ListOf
from api.service import batch_output, file_store
from jobs.settings import ApiKey, Settings
from jobs.tables import Batch
from jobs.tables import File as FileRow

PURPOSES = ("batch",)  # what an upload may be for; a batch's results have purpose `batch_output`
UPLOAD_PURPOSE = "batch_upload"  # a multipart batch upload's lines, kept until they are jobs: never shown
FILE_ID = re.compile(r"file-[0-9a-f]{32}")  # every upload's id: anything else names none (nor reaches SQL)


def file_out(row: FileRow) -> FileOut:
    return FileOut(id=row.id, bytes=row.size, created_at=unix(row.created_at), filename=row.filename,
                   purpose=row.purpose)


def _missing(file_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"no file {file_id}")


def _visible_batch(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> Batch | None:
    batch = session.get(Batch, batch_id)
    return batch if batch is not None and sees(caller, batch.tenant) else None


def _visible_file(session: Session, file_id: str, caller: ApiKey, lock: bool = False) -> FileRow | None:
    """The caller's upload `file_id`, or None; with `lock`, its row locked against deletion until the caller's
    transaction ends."""
    if not FILE_ID.fullmatch(file_id):
        return None
    rows = select(FileRow).where(FileRow.id == file_id)
    row = session.scalar(rows.with_for_update(read=True, key_share=True) if lock else rows)
    return row if row is not None and row.purpose in PURPOSES and sees(caller, row.tenant) else None


def upload(session: Session, settings: Settings, caller: ApiKey, purpose: str, name: str | None,
           data: IO[bytes]) -> FileOut:
    """Keep an upload of `purpose` `batch` (else 400), at most CONVOQ_MAX_UPLOAD_BYTES (else 413), a chunk at a
    time."""
    if purpose not in PURPOSES:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"purpose {purpose!r} is not supported: convoq keeps "
                                                         "files for batches only (purpose=batch)")
    row, _ = file_store.keep(session, caller, purpose, name, data, settings)
    session.commit()
    return file_out(row)


def batch_input_file(session: Session, file_id: str, caller: ApiKey) -> FileRow:
    """The caller's upload a batch is made from (every upload's purpose is `batch`), locked against deletion until
    the caller's transaction ends (the batch that names it then keeps it); 404 when there is none such."""
    row = _visible_file(session, file_id, caller, lock=True)
    if row is None:
        raise _missing(file_id)
    return row


def list_page(session: Session, caller: ApiKey, purpose: str | None, after: str | None, limit: int,
              newest_first: bool) -> ListOf[FileOut]:
    """The caller's files (of `purpose`, if given), a page after `after` (404 when it names none of them)."""
    purposes = PURPOSES if purpose is None else [p for p in PURPOSES if p == purpose]
    rows = visible(select(FileRow), FileRow, caller).where(FileRow.purpose.in_(purposes))
    found, more = page(session, rows, FileRow, after, limit, newest_first=newest_first)
    return list_of([file_out(row) for row in found], more)


def get(session: Session, sessions: sessionmaker[Session], file_id: str, model: str, caller: ApiKey) -> FileOut:
    """The File object of an upload or of a batch's output or error file; 404 when the caller has none such.
    A batch's file is sized from its lines' stored lengths (`batch_output.size`): these files exist only as they
    are read, and their log-probabilities are never read to size them."""
    if (batch := batch_output.parse_batch_file_id(file_id)) is not None:
        batch_id, of_errors = batch
        found = _visible_batch(session, batch_id, caller)
        if found is None:
            raise _missing(file_id)
        size = batch_output.size(sessions, batch_id, of_errors, model)
        return FileOut(id=file_id, bytes=size, created_at=unix(found.created_at), purpose="batch_output",
                       filename=f"batch_{batch_id.hex}_{'error' if of_errors else 'output'}.jsonl")
    row = _visible_file(session, file_id, caller)
    if row is None:
        raise _missing(file_id)
    return file_out(row)


def content(session: Session, sessions: sessionmaker[Session], file_id: str, model: str,
            caller: ApiKey) -> tuple[int | None, Iterator[bytes]]:
    """An upload's size and its bytes a chunk at a time, or a batch's output or error lines as they are read
    (their size unknown until then); 404 when the caller has no such file."""
    if (batch := batch_output.parse_batch_file_id(file_id)) is not None:
        if _visible_batch(session, batch[0], caller) is None:
            raise _missing(file_id)
        return None, batch_output.lines(sessions, *batch, model)
    row = _visible_file(session, file_id, caller)
    if row is None:
        raise _missing(file_id)
    return row.size, file_store.download(sessions, row.id, row.size)


def remove(session: Session, file_id: str, caller: ApiKey) -> FileDeleted:
    """Delete an upload of the caller's; 400 for a batch's file (nothing is stored), 404 when there is none,
    409 while a batch is still reading its lines."""
    if batch_output.parse_batch_file_id(file_id) is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {file_id} is a batch's results, read from the "
                                                         "batch on each download: there is nothing to delete")
    if _visible_file(session, file_id, caller) is None:
        raise _missing(file_id)
    try:
        session.execute(delete(FileRow).where(FileRow.id == file_id))
        session.commit()
    except IntegrityError:  # `Batch.source_file_id`: a batch made from it is validating
        session.rollback()
        raise HTTPException(status.HTTP_409_CONFLICT, f"file {file_id} is being read by a batch that is still "
                                                      "validating; delete it once the batch is in progress") from None
    return FileDeleted(id=file_id)
