"""`/v1/files`: OpenAI's Files API, for batches. Uploads (purpose `batch`) are kept in the database and become
batches by id (`POST /v1/batches` with `input_file_id`); a batch's output and error files are read from its
jobs (`api.service.batch_output`) and cannot be deleted."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response, StreamingResponse

from api.http.deps import JSONL, JSONL_TYPE, V1_ERRORS, Caller, SessionDep, SessionsDep, SettingsDep, errors
from api.schemas.files import FileDeleted, FileOut
from api.schemas.lists import ListOf
from api.service import files

router = APIRouter(prefix="/v1/files", tags=["files"], responses=V1_ERRORS)

NOT_FOUND = errors(e404="No such file (or another tenant's)")


@router.post("", response_model=FileOut,
             responses=errors(e400="A purpose other than `batch`",
                              e413="The file is larger than CONVOQ_MAX_UPLOAD_BYTES"))
def upload_file(
    file: Annotated[UploadFile, File(description="JSONL: OpenAI Batch lines or convoq lines")],
    # any other purpose is OpenAI's 400 (the SDK's BadRequestError); the enum says so up front
    purpose: Annotated[str, Form(description="`batch`, the only purpose kept here",
                                 json_schema_extra={"enum": list(files.PURPOSES)})],
    session: SessionDep,
    settings: SettingsDep,
    caller: Caller,
) -> FileOut:
    """Upload a batch input file; `POST /v1/batches` with its id runs it."""
    return files.upload(session, settings, caller, purpose, file.filename, file.file)


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
    return files.list_page(session, caller, purpose, after, limit, newest_first=order == "desc")


@router.get("/{file_id}", response_model=FileOut, responses=NOT_FOUND)
def get_file(file_id: str, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
             caller: Caller) -> FileOut:
    return files.get(session, sessions, file_id, settings.model, caller)


@router.get("/{file_id}/content", response_class=Response,
            responses={**NOT_FOUND, 200: {"description": "The file's bytes: an upload as it came, a batch's output "
                                                         "or error file as JSON Lines", "content": {
                "application/octet-stream": {}, **JSONL[200]["content"]}}})
def file_content(file_id: str, session: SessionDep, sessions: SessionsDep, settings: SettingsDep,
                 caller: Caller) -> Response:
    size, found = files.content(session, sessions, file_id, settings.model, caller)
    if size is None:
        return StreamingResponse(found, media_type=JSONL_TYPE)
    return StreamingResponse(found, media_type="application/octet-stream", headers={"Content-Length": str(size)})


@router.delete("/{file_id}", response_model=FileDeleted,
               responses={**NOT_FOUND, **errors(e400="A batch's output or error file (they are read from the "
                                                     "batch, not stored)",
                                                e409="A batch made from it is still validating (reading its lines)")})
def delete_file(file_id: str, session: SessionDep, caller: Caller) -> FileDeleted:
    """Delete an upload of this tenant. Batches made from it keep running."""
    return files.remove(session, file_id, caller)
