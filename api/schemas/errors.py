"""The error body every route answers with, and OpenAI's `error` object in it."""

from __future__ import annotations

from pydantic import BaseModel


class ValidationIssue(BaseModel):
    """One problem of a request that does not validate (FastAPI's shape; `input` is a short repr of the value)."""

    loc: list[str | int]
    msg: str
    type: str
    input: str | None = None


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorOut(BaseModel):
    """Every error body: `detail` is a sentence, or for a 422 the list of problems; routes the `openai` SDK calls
    also carry OpenAI's `error` object."""

    detail: str | list[ValidationIssue]
    error: OpenAIError | None = None
