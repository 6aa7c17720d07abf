"""The two bodies of `POST /v1/batches` as one `BatchInput`: a multipart upload of the JSONL (stored by
`batches.create`, a chunk at a time) or OpenAI's JSON naming a stored file (`input_file_id`); and their OpenAPI
description."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import IO, TypeVar

from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from api.schemas.batches import ENDPOINTS, BatchCreate, BatchUpload
from api.service.batch_output import parse_batch_file_id
from jobs.bounded_json import bounded_json
from jobs.settings import Settings

M = TypeVar("M", bound=BaseModel)


@dataclass
class BatchInput:
    """A new batch's lines and options, from either body of `POST /v1/batches`: exactly one of `upload` and
    `input_file_id`."""

    upload: IO[bytes] | None  # the multipart upload's JSONL (the form's spooled file), to be stored
    input_file_id: str | None  # a stored file's id
    name: str | None
    priority: int | None  # the body's; None when it says none
    metadata: dict[str, str]
    completion_window: str


@asynccontextmanager
async def batch_input(request: Request, settings: Settings) -> AsyncIterator[BatchInput]:
    """The body as a `BatchInput`, for as long as the context lasts (a multipart upload's file is the form's);
    400, 413, 415 or 422 when it cannot be one. Nothing here waits on the database."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media == "multipart/form-data":
        # the multipart parser spools the file to disk past 1 MiB
        async with request.form(max_files=1, max_fields=16) as form:
            names = [name for name, _ in form.multi_items()]
            if repeated := sorted({name for name in names if names.count(name) > 1}):
                raise RequestValidationError([{"loc": ("body", name), "msg": "given more than once",
                                               "type": "value_error"} for name in repeated])
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise RequestValidationError([{"loc": ("body", "file"), "msg": "a JSONL file is required",
                                               "type": "missing"}])
            fields = _validated(BatchUpload, {k: v for k, v in form.items() if k != "file"})
            yield BatchInput(upload=upload.file, input_file_id=None, name=upload.filename, priority=fields.priority,
                             metadata=fields.metadata or {}, completion_window=fields.completion_window)
    elif media == "application/json":
        try:
            body = bounded_json(await _body(request, settings.max_request_bytes))
        except ValueError as exc:
            raise RequestValidationError([{"loc": ("body",), "msg": f"not a JSON body: {exc}",
                                           "type": "json_invalid"}]) from None
        spec = _validated(BatchCreate, body)
        if spec.endpoint not in ENDPOINTS:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"endpoint {spec.endpoint!r} is not served here; a "
                                                             f"batch may call {', '.join(ENDPOINTS)}")
        if parse_batch_file_id(spec.input_file_id) is not None:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"file {spec.input_file_id} is a batch's results "
                                                             "(purpose batch_output); upload the requests with "
                                                             "purpose=batch")
        yield BatchInput(upload=None, input_file_id=spec.input_file_id, name=None, priority=spec.priority,
                         metadata=spec.metadata or {}, completion_window=spec.completion_window)
    else:
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


async def _body(request: Request, limit: int) -> bytes:
    """A JSON body, read up to CONVOQ_MAX_REQUEST_BYTES (the gate lets an upload's size through on this path)."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"a JSON body takes at most {limit} bytes")
    return bytes(body)


def _validated(model: type[M], data: object) -> M:
    """`data` as `model`, or the 422 FastAPI gives for a body it validates itself."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
