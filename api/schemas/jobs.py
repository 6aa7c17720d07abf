"""What `/v1/jobs` answers: an accepted job, a job with its result and timings, and its progress events."""

from __future__ import annotations

from datetime import datetime
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.results import ResultOut
from jobs.error_codes import ErrorCode
from jobs.status import JobStatus


class JobAccepted(BaseModel):
    id: UUID
    status: JobStatus
    created: bool = Field(description="false when the idempotency key matched an existing job")


class TimingsOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    queue_wait_ms: float
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    engine_ms: float
    end_to_end_ms: float
    tokens_per_s: float
    engine_step: str | None = Field(description="`worker:step`: the engine step that first ran the job; shown to "
                                                "admin keys, null for tenant keys (it names the worker's host)")
    batch_size: int
    prompt_tokens_reused: int
    host_tokens_reused: int


class JobOut(BaseModel):
    id: UUID
    status: JobStatus
    kind: str
    priority: int
    conversation_id: str | None
    attempts: int
    error: str | None = Field(description="why it did not succeed (or why its last attempt failed), in a short "
                                          "message that is the same for every job it befalls")
    error_code: ErrorCode | None = Field(None, description="what `error` is, as OpenAI's `error.code`: "
                                         + ", ".join(code.value for code in ErrorCode))
    error_detail: str | None = Field(None, description="what raised, as the worker logged it: shown to admin keys, "
                                                       "null for tenant keys")
    worker: str | None = Field(description="the worker that runs or ran the job: shown to admin keys, null for "
                                           "tenant keys (host names are the operators' business)")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    deadline_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    result: ResultOut | None = None
    timings: TimingsOut | None = None


class JobEvent(BaseModel):
    """One event of `GET /v1/jobs/{id}/events` (Server-Sent Events; the event name is `event`)."""

    event: Literal["status", "text", "result", "error"]
    status: JobStatus | None = None  # status: the job's status now
    text: str | None = Field(None, description="text: everything generated so far (each one extends the last)")
    tokens: int | None = None  # text: tokens generated so far
    job: JobOut | None = None  # result: the finished job, as GET /v1/jobs/{id}
    error: str | None = Field(None, description="error (the last event): the text streamed so far is not the "
                                                "job's (it ran again after a crash); read the job for its result")
