"""The two bodies of `POST /v1/batches` as one `BatchInput`: a multipart upload of the JSONL (spooled to a
temporary file) or OpenAI's JSON naming a stored file (`input_file_id`); and their OpenAPI description."""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, TypeVar

from fastapi import HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session, undefer
from starlette.datastructures import UploadFile

from api.deps import sees
from api.service.batch_output import parse_batch_file_id
from jobs.schemas import ENDPOINTS, BatchCreate, BatchUpload
from jobs.settings import ApiKey, Settings
from jobs.tables import File

M = TypeVar("M", bound=BaseModel)


@dataclass
class BatchInput:
    """A new batch's lines and options, from either body of `POST /v1/batches`."""

    source: IO[bytes]  # the lines, at the start of a temporary file (or of the stored file's bytes)
    lines: int  # non-blank lines
    name: str | None
    input_file_id: str | None
    priority: int | None  # the body's; None when it says none
    metadata: dict
    completion_window: str


async def batch_input(request: Request, session: Session, caller: ApiKey, settings: Settings) -> BatchInput:
    """The body as a `BatchInput` (its `source` is the caller's to close): 400, 404, 413, 415 or 422 when it
    cannot be one."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media == "multipart/form-data":
        return await _from_upload(request, settings)
    if media == "application/json":
        spec = _validated(BatchCreate, await request.body())
        return await run_in_threadpool(_from_file, session, spec, caller, settings)  # may be many megabytes
    raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                        "send application/json with input_file_id (OpenAI's way) or multipart/form-data with the "
                        "JSONL as `file`")


def request_bodies() -> dict:
    """The two bodies `batch_input` reads itself, for the OpenAPI document (`openapi_extra`)."""
    upload = BatchUpload.model_json_schema()
    upload["properties"] = {"file": {"type": "string", "format": "binary",
                                     "description": "JSONL: OpenAI Batch lines or convoq lines"},
                            **upload["properties"]}
    upload["required"] = ["file"]
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": BatchCreate.model_json_schema()},
        "multipart/form-data": {"schema": upload, "encoding": {"metadata": {"contentType": "application/json"}}},
    }}}


def _validated(model: type[M], data: bytes | dict) -> M:
    """`data` as `model`, or the 422 FastAPI gives for a body it validates itself."""
    try:
        return model.model_validate_json(data) if isinstance(data, bytes) else model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


def _spool(lines: Iterable[bytes], settings: Settings) -> tuple[IO[bytes], int]:
    """`lines` copied into a temporary file, one line at a time, and their non-blank count; 413 past the
    upload limits. The caller owns (and closes) the file."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 (handed to the ingest, which closes it)
    size = count = 0
    try:
        for line in lines:
            size += len(line)
            count += bool(line.strip())
            if size > settings.max_upload_bytes or count > settings.max_batch_lines:
                raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                    f"a batch takes at most {settings.max_batch_lines} lines and "
                                    f"{settings.max_upload_bytes} bytes; split it into several batches")
            out.write(line)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out, count


async def _from_upload(request: Request, settings: Settings) -> BatchInput:
    # the multipart parser itself spools the file to disk past 1 MiB; it is copied (on disk) once more, since
    # the form's files are gone when this returns and the lines are read after the answer
    async with request.form(max_files=1, max_fields=16) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise RequestValidationError([{"loc": ("body", "file"), "msg": "a JSONL file is required",
                                           "type": "missing"}])
        fields = _validated(BatchUpload, {k: v for k, v in form.items() if k != "file"})
        source, lines = await run_in_threadpool(_spool, upload.file, settings)
    return BatchInput(source=source, lines=lines, name=upload.filename, input_file_id=None, priority=fields.priority,
                      metadata=fields.metadata or {}, completion_window=fields.completion_window)


def _from_file(session: Session, spec: BatchCreate, caller: ApiKey, settings: Settings) -> BatchInput:
    if spec.endpoint not in ENDPOINTS:
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"endpoint {spec.endpoint!r} is not served here; a batch may call {', '.join(ENDPOINTS)}")
    if parse_batch_file_id(spec.input_file_id) is not None:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {spec.input_file_id} is a batch's results (purpose "
                                                         "batch_output); upload the requests with purpose=batch")
    file = session.get(File, spec.input_file_id, options=[undefer(File.content)])
    if file is None or not sees(caller, file.tenant):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no file {spec.input_file_id}")
    if file.purpose != "batch":
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"file {file.id} has purpose {file.purpose!r}; a batch's input needs purpose 'batch'")
    lines = sum(1 for line in io.BytesIO(file.content) if line.strip())
    if lines > settings.max_batch_lines:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {file.id} has {lines} lines; a batch takes at most "
                                                         f"{settings.max_batch_lines}: split it into several files")
    return BatchInput(source=io.BytesIO(file.content), lines=lines, name=file.filename, input_file_id=file.id,
                      priority=spec.priority, metadata=spec.metadata or {}, completion_window=spec.completion_window)
