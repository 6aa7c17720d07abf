"""`/v1/batches`' bodies and answers: a batch created from OpenAI's JSON or a multipart upload, the batch, its
bad lines."""

from __future__ import annotations

from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from api.schemas.metadata import Metadata, PriorityMetadata, metadata_priority
from api.schemas.windows import DEFAULT_COMPLETION_WINDOW, Window
from jobs.bounded_json import bounded_json
from jobs.priority import RANGE, Priority
from jobs.schemas import NO_NUL
from jobs.status import BatchStatus


class RequestCounts(BaseModel):
    total: int  # lines in the upload
    completed: int
    failed: int  # bad lines + jobs that failed
    invalid: int = Field(0, description="lines that could not become jobs (listed at GET /v1/batches/{id}/line_errors)")
    cancelled: int
    expired: int  # not finished within the completion window
    pending: int  # queued or running


class BatchLineError(BaseModel):
    """A line that could not become a job: OpenAI's BatchError, plus the line's `custom_id` when it had one."""

    code: str = "invalid_line"
    message: str
    param: str | None = None
    line: int | None = Field(description="1-based line number in the input")
    custom_id: str | None = None


class BatchOut(BaseModel):
    """Shaped like OpenAI's Batch object (timestamps in Unix seconds), plus `priority`, `input_name` and the
    extra `request_counts`."""

    id: UUID
    object: Literal["batch"] = "batch"
    endpoint: str = "/v1/chat/completions"
    status: BatchStatus
    priority: int
    input_name: str | None
    input_file_id: str | None = Field(None, description="the uploaded file it was made from (None: a multipart "
                                                        "upload)")
    output_file_id: str | None = Field(None, description="once the batch settled with succeeded items: their "
                                                         "output lines, at GET /v1/files/{id}/content")
    error_file_id: str | None = Field(None, description="once the batch settled with bad lines or failed, "
                                                        "cancelled or expired items: their error lines")
    request_counts: RequestCounts
    metadata: dict[str, str]
    completion_window: str
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    failed_at: int | None
    expired_at: int | None


ENDPOINTS = ("/v1/chat/completions",)  # what a batch's lines may call


class BatchCreate(BaseModel):
    """`POST /v1/batches` as JSON, OpenAI's way: the requests are in a file uploaded with purpose `batch`.
    Priority rides in `metadata["priority"]` ("0".."9"; OpenAI metadata values are strings) or the
    `X-Convoq-Priority` header; bulk work defaults low."""

    # OpenAI's options that do not apply here (`output_expires_after`) are accepted and ignored
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(max_length=64, pattern=NO_NUL)
    # a 400 (OpenAI's answer) for any other endpoint; the enum tells clients so up front
    endpoint: str = Field(description=f"one of {', '.join(ENDPOINTS)}", json_schema_extra={"enum": list(ENDPOINTS)})
    completion_window: Window = Field(DEFAULT_COMPLETION_WINDOW,
                                      description="as OpenAI's '24h' (also '90m', '2d'), at most 7 days")
    metadata: PriorityMetadata = None

    @property
    def priority(self) -> int | None:
        return metadata_priority(self.metadata)


class BatchUpload(BaseModel):
    """`POST /v1/batches` as multipart/form-data (our client and CLI): the JSONL itself, in `file`."""

    priority: Priority | None = Field(None, description=f"{RANGE}; bulk work defaults low")
    metadata: Metadata | None = Field(None, description="a JSON object of strings kept with the batch (OpenAI's "
                                                        "bounds: 16 keys of 64 characters, values of 512)")
    completion_window: Window = Field(DEFAULT_COMPLETION_WINDOW, description=(
        "how long the batch may take, as OpenAI's '24h' (also '90m', '2d'), at most 7 days; items unfinished by "
        "then end `expired`"))

    @field_validator("priority", "metadata", mode="before")
    @classmethod
    def _form_text(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):  # a form field is text
            return value
        if value.strip() in ("", "null"):  # nothing, or JSON's null (as clients write a None): no value
            return None
        if info.field_name == "priority":
            return value
        try:
            return bounded_json(value)
        except ValueError as exc:
            raise ValueError(f"metadata must be a JSON object: {exc}") from None
