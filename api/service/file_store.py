"""Files in the database a chunk at a time (`FileChunk`, `CHUNK_BYTES` each): an upload is written as it is read,
and read back chunk by chunk, so memory per upload or download is one chunk whatever the file's size."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import IO

from fastapi import HTTPException, status
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from api.service.batch_input import count_lines
from jobs.settings import ApiKey, Settings
from jobs.tables import CHUNK_BYTES, FileChunk, utcnow
from jobs.tables import File as FileRow

MAX_NAME = 255  # `File.filename`, `Batch.input_name`


def stored_name(name: str | None) -> str:
    """An upload's file name as it may be stored: PostgreSQL text holds no NUL, the column 255 characters."""
    return (name or "").replace("\x00", "")[:MAX_NAME] or "upload.jsonl"


def keep(session: Session, caller: ApiKey, purpose: str, name: str | None, source: IO[bytes], settings: Settings,
         max_lines: int | None = None) -> tuple[FileRow, int]:
    """Store `source` as a new file of the caller's, a chunk per row as it is read (uncommitted); the row and
    its non-blank lines. 413 past CONVOQ_MAX_UPLOAD_BYTES, or past `max_lines` lines."""
    row = FileRow(id=f"file-{uuid.uuid4().hex}", purpose=purpose, filename=stored_name(name), size=0,
                  owner=caller.digest, tenant=caller.tenant, created_at=utcnow())
    session.add(row)
    session.flush()  # the chunks refer to it

    def stored() -> Iterator[bytes]:
        for seq in itertools.count():
            if not (piece := source.read(CHUNK_BYTES)):
                return
            row.size += len(piece)
            if row.size > settings.max_upload_bytes:
                raise _too_large(settings)
            session.execute(insert(FileChunk.__table__), {"file_id": row.id, "seq": seq, "data": piece})
            yield piece

    lines = count_lines(stored(), settings.max_request_bytes, stop_after=max_lines)
    if max_lines is not None and lines > max_lines:
        raise _too_large(settings)
    return row, lines


def _too_large(settings: Settings) -> HTTPException:
    return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                         f"a batch takes at most {settings.max_batch_lines} lines and {settings.max_upload_bytes} "
                         "bytes; split it into several batches")


def pieces(session: Session, file_id: str) -> Iterator[bytes]:
    """A stored file's bytes, a chunk per round trip on `session`."""
    for seq in itertools.count():
        data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
        if data is None:
            return
        yield data


def download(sessions: sessionmaker[Session], file_id: str, size: int) -> Iterator[bytes]:
    """A stored file's bytes for a response, each chunk read in a short session of its own (a slow client holds
    no connection). A file deleted while it is sent ends the response short of its length, not silently."""
    sent = 0
    for seq in itertools.count():
        with sessions() as session:
            data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
        if data is None:
            break
        sent += len(data)
        yield data
    if sent != size:
        raise RuntimeError(f"file {file_id} was deleted while it was sent ({sent} of {size} bytes)")
