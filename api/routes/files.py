"""`/v1/files`: OpenAI's Files API, for batches. Uploads (purpose `batch`) are kept in the database and become
batches by id (`POST /v1/batches` with `input_file_id`); a batch's output and error files are read from its
jobs (`api.routes.batches.batch_file`) and cannot be deleted."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, HTTPException, Query, UploadFile, status
from fastapi.responses import Response
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from api.deps import V1_ERRORS, Caller, SessionDep, SessionsDep, SettingsDep, errors, sees, visible
from api.paging import list_of, page
from api.routes.batches import JSONL, batch_file, batch_lines, parse_batch_file_id
from jobs.schemas import FileDeleted, FileOut, ListOf
from jobs.settings import ApiKey
from jobs.tables import Batch, as_utc, utcnow
from jobs.tables import File as FileRow

router = APIRouter(prefix="/v1/files", tags=["files"], responses=V1_ERRORS)

PURPOSES = ("batch",)  # what an upload may be for; a batch's results have purpose `batch_output`
NOT_FOUND = errors(e404="No such file (or another tenant's)")


def _unix(row: FileRow | Batch) -> int:
    return int(as_utc(row.created_at).timestamp())


def file_out(row: FileRow) -> FileOut:
    return FileOut(id=row.id, bytes=row.size, created_at=_unix(row), filename=row.filename, purpose=row.purpose)


def _visible_batch(session: Session, batch_id: uuid.UUID, caller: ApiKey) -> Batch | None:
    batch = session.get(Batch, batch_id)
    return batch if batch is not None and sees(caller, batch.tenant) else None


def _batch_file_out(session: Session, sessions: sessionmaker[Session], file_id: str, batch_id: uuid.UUID,
                    of_errors: bool, model: str, caller: ApiKey) -> FileOut | None:
    """The File object of a batch's output or error file; None if there is no such batch (for this caller).
    Its size is counted by reading its lines: these files exist only as they are read."""
    batch = _visible_batch(session, batch_id, caller)
    if batch is None:
        return None
    size = sum(len(line) for line in batch_lines(sessions, batch_id, of_errors, model))
    return FileOut(id=file_id, bytes=size, created_at=_unix(batch), purpose="batch_output",
                   filename=f"batch_{batch_id.hex}_{'error' if of_errors else 'output'}.jsonl")


def _missing(file_id: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"no file {file_id}")


@router.post("", response_model=FileOut,
             responses=errors(e400="A purpose other than `batch`",
                              e413="The file is larger than CONVOQ_MAX_UPLOAD_BYTES"))
def upload_file(
    file: Annotated[UploadFile, File(description="JSONL: OpenAI Batch lines or convoq lines")],
    # any other purpose is OpenAI's 400 (the SDK's BadRequestError); the enum says so up front
    purpose: Annotated[str, Form(description="`batch`, the only purpose kept here",
                                 json_schema_extra={"enum": list(PURPOSES)})],
    session: SessionDep,
    settings: SettingsDep,
    caller: Caller,
) -> FileOut:
    """Upload a batch input file; `POST /v1/batches` with its id runs it."""
    if purpose not in PURPOSES:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"purpose {purpose!r} is not supported: convoq keeps "
                                                         "files for batches only (purpose=batch)")
    data = file.file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                            f"the file exceeds {settings.max_upload_bytes} bytes; split it into several files")
    row = FileRow(id=f"file-{uuid.uuid4().hex}", purpose=purpose, filename=file.filename or "upload.jsonl",
                  size=len(data), owner=caller.digest, tenant=caller.tenant, created_at=utcnow(), content=data)
    session.add(row)
    session.commit()
    return file_out(row)


@router.get("", response_model=ListOf[FileOut], responses=errors(e404="`after` names no file of this tenant"))
def list_files(
    session: SessionDep,
    caller: Caller,
    purpose: str | None = None,
    after: Annotated[str | None, Query(description="the last id of the page before")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> ListOf[FileOut]:
    """The files of this tenant, in OpenAI's list object (by creation time, newest first by default)."""
    rows = visible(select(FileRow), FileRow, caller)
    if purpose is not None:
        rows = rows.where(FileRow.purpose == purpose)
    found, more = page(session, rows, FileRow, after, limit, newest_first=order == "desc")
    return list_of([file_out(row) for row in found], more)


@router.get("/{file_id}", response_model=FileOut, responses=NOT_FOUND)
def get_file(file_id: str, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
             caller: Caller) -> FileOut:
    if (batch := parse_batch_file_id(file_id)) is not None:
        out = _batch_file_out(session, sessions, file_id, *batch, settings.model, caller)
    else:
        row = session.get(FileRow, file_id)
        out = None if row is None or not sees(caller, row.tenant) else file_out(row)
    if out is None:
        raise _missing(file_id)
    return out


@router.get("/{file_id}/content", response_class=Response,
            responses={**NOT_FOUND, 200: {"description": "The file's bytes: an upload as it came, a batch's output "
                                                         "or error file as JSON Lines", "content": {
                "application/octet-stream": {}, **JSONL[200]["content"]}}})
def file_content(file_id: str, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> Response:
    if (batch := parse_batch_file_id(file_id)) is not None:
        if _visible_batch(session, batch[0], caller) is None:
            raise _missing(file_id)
        return batch_file(sessions, *batch, settings.model)
    content = session.scalar(visible(select(FileRow.content), FileRow, caller).where(FileRow.id == file_id))
    if content is None:
        raise _missing(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted,
               responses={**NOT_FOUND, **errors(e400="A batch's output or error file (they are read from the "
                                                     "batch, not stored)")})
def delete_file(file_id: str, session: SessionDep, caller: Caller) -> FileDeleted:
    """Delete an upload of this tenant. Batches made from it keep running."""
    if parse_batch_file_id(file_id) is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {file_id} is a batch's results, read from the "
                                                         "batch on each download: there is nothing to delete")
    deleted = session.scalar(visible(delete(FileRow), FileRow, caller).where(FileRow.id == file_id)
                             .returning(FileRow.id))
    session.commit()
    if deleted is None:
        raise _missing(file_id)
    return FileDeleted(id=file_id)

