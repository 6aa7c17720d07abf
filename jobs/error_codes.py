"""Why a job did not succeed: its error code, the message each code shows, and how a stored error is shown."""

from __future__ import annotations

import enum

from jobs.status import JobStatus


class ErrorCode(enum.StrEnum):
    """Why a job did not succeed, as its tenant is told (OpenAI's `error.code`): `jobs.error_code`, next to a short
    message in `jobs.error`. What raised, and where, is `jobs.error_detail`, for admin keys and the worker's log."""

    engine_error = "engine_error"  # the service failed to run it, at every attempt
    crashed = "crashed"  # workers died while it ran, too often to try it again
    timeout = "timeout"  # its engine stalled with it inside, in two runs
    invalid_prompt = "invalid_prompt"  # its request can never run as asked (chat template, grammar, sampling)
    too_long = "too_long"  # its prompt and max_new_tokens do not fit the model's context
    cancelled = "cancelled"
    expired = "expired"  # its deadline passed


# The message of each code, where it is fixed. A request's own problem (`invalid_prompt`, `too_long`) is told in
# the words that checked it, which name only what the request asked for.
ERROR_MESSAGES = {
    ErrorCode.engine_error: "the engine failed to run this job",
    ErrorCode.crashed: "workers died while running this job, too often to try it again",
    ErrorCode.timeout: "the engine stalled while running this job, twice; it is not tried again",
    ErrorCode.invalid_prompt: "the request cannot run on this model",
    ErrorCode.too_long: "the prompt and max_new_tokens exceed the model's context",
    ErrorCode.cancelled: "cancelled before it ran",
    ErrorCode.expired: "its deadline passed before it ran",
}
# a run stopped part way: its text so far is its result
STOPPED_MESSAGES = {
    ErrorCode.cancelled: "cancelled while it ran; the text it had is kept in its result",
    ErrorCode.expired: "its deadline passed while it ran; the text it had is kept in its result",
}
REQUEST_ERRORS = frozenset({ErrorCode.invalid_prompt, ErrorCode.too_long})  # the request's fault: OpenAI's 400
# before error codes, a failure of the request was told by this prefix of its error (`shown_error`)
INVALID_REQUEST = "invalid request: "


def error_columns(code: ErrorCode, message: str | None = None, detail: str | None = None) -> dict[str, str | None]:
    """A job's error as stored: `message` (default: the code's own) for its tenant, `detail` for operators."""
    return dict(error=message or ERROR_MESSAGES[code], error_code=code.value, error_detail=detail)


def shown_error(status: str, error: str | None, code: str | None) -> tuple[ErrorCode | None, str | None]:
    """The code and message a job's stored error shows. A row settled before error codes has none, and its error
    may be an exception's text (SQL and its parameters, a host name): it shows the code its status implies, with
    that code's message, or the request's problem, which its error's prefix told apart."""
    if code is not None:
        return ErrorCode(code), error
    if status == JobStatus.succeeded or (status in (JobStatus.queued, JobStatus.running) and error is None):
        return None, None
    if status in (JobStatus.cancelled, JobStatus.expired):
        return ErrorCode(status), error or ERROR_MESSAGES[ErrorCode(status)]  # ours: never an exception's text
    if error and error.startswith(INVALID_REQUEST):
        return ErrorCode.invalid_prompt, error.removeprefix(INVALID_REQUEST)
    return ErrorCode.engine_error, ERROR_MESSAGES[ErrorCode.engine_error]
