"""Files (OpenAI's Files API, for batches): uploads kept in the database, and each batch's output and error
files, which are read from its jobs (`batch_output`) and cannot be deleted."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import IO

from fastapi import HTTPException, status
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from api.deps import sees, visible
from api.openai_objects import unix
from api.paging import list_of, page
from api.service import batch_output
from jobs.schemas import FileDeleted, FileOut, ListOf
from jobs.settings import ApiKey, Settings
from jobs.tables import Batch, utcnow
from jobs.tables import File as FileRow

PURPOSES = ("batch",)  # what an upload may be for; a batch's results have purpose `batch_output`


def file_out(row: FileRow) -> FileOut:
    return FileOut(id=row.id, bytes=row.size, created_at=unix(row.created_at), filename=row.filename,
                   purpose=row.purpose)


def _missing(file_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"no file {file_id}")


def _visible_batch(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> Batch | None:
    batch = session.get(Batch, batch_id)
    return batch if batch is not None and sees(caller, batch.tenant) else None


def upload(session: Session, settings: Settings, caller: ApiKey, purpose: str, name: str | None,
           data: IO[bytes]) -> FileOut:
    """Keep an upload of `purpose` `batch` (else 400), at most CONVOQ_MAX_UPLOAD_BYTES (else 413)."""
    if purpose not in PURPOSES:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"purpose {purpose!r} is not supported: convoq keeps "
                                                         "files for batches only (purpose=batch)")
    content = data.read(settings.max_upload_bytes + 1)
    if len(content) > settings.max_upload_bytes:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            f"the file exceeds {settings.max_upload_bytes} bytes; split it into several files")
    row = FileRow(id=f"file-{uuid.uuid4().hex}", purpose=purpose, filename=name or "upload.jsonl",
                  size=len(content), owner=caller.digest, tenant=caller.tenant, created_at=utcnow(), content=content)
    session.add(row)
    session.commit()
    return file_out(row)


def list_page(session: Session, caller: ApiKey, purpose: str | None, after: str | None, limit: int,
              newest_first: bool) -> ListOf[FileOut]:
    """The caller's files (of `purpose`, if given), a page after `after` (404 when it names none of them)."""
    rows = visible(select(FileRow), FileRow, caller)
    if purpose is not None:
        rows = rows.where(FileRow.purpose == purpose)
    found, more = page(session, rows, FileRow, after, limit, newest_first=newest_first)
    return list_of([file_out(row) for row in found], more)


def get(session: Session, sessions: sessionmaker[Session], file_id: str, model: str, caller: ApiKey) -> FileOut:
    """The File object of an upload or of a batch's output or error file; 404 when the caller has none such.
    A batch's file is sized by reading its lines: these files exist only as they are read."""
    if (batch := batch_output.parse_batch_file_id(file_id)) is not None:
        batch_id, of_errors = batch
        found = _visible_batch(session, batch_id, caller)
        if found is None:
            raise _missing(file_id)
        size = sum(len(line) for line in batch_output.lines(sessions, batch_id, of_errors, model))
        return FileOut(id=file_id, bytes=size, created_at=unix(found.created_at), purpose="batch_output",
                       filename=f"batch_{batch_id.hex}_{'error' if of_errors else 'output'}.jsonl")
    row = session.get(FileRow, file_id)
    if row is None or not sees(caller, row.tenant):
        raise _missing(file_id)
    return file_out(row)


def content(session: Session, sessions: sessionmaker[Session], file_id: str, model: str,
            caller: ApiKey) -> bytes | Iterator[bytes]:
    """An upload's bytes, or a batch's output or error lines as they are read; 404 when the caller has no such
    file."""
    if (batch := batch_output.parse_batch_file_id(file_id)) is not None:
        if _visible_batch(session, batch[0], caller) is None:
            raise _missing(file_id)
        return batch_output.lines(sessions, *batch, model)
    found = session.scalar(visible(select(FileRow.content), FileRow, caller).where(FileRow.id == file_id))
    if found is None:
        raise _missing(file_id)
    return found


def remove(session: Session, file_id: str, caller: ApiKey) -> FileDeleted:
    """Delete an upload of the caller's; 400 for a batch's file (nothing is stored), 404 when there is none."""
    if batch_output.parse_batch_file_id(file_id) is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {file_id} is a batch's results, read from the "
                                                         "batch on each download: there is nothing to delete")
    deleted = session.scalar(visible(delete(FileRow), FileRow, caller).where(FileRow.id == file_id)
                             .returning(FileRow.id))
    session.commit()
    if deleted is None:
        raise _missing(file_id)
    return FileDeleted(id=file_id)
