"""The job contract, shared by the API, the client and the worker (pydantic v2).

A job's priority is `jobs.priority.Priority`, the highest the most urgent.
"""

from __future__ import annotations

import enum
import json
import math
import re
import sys
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from jobs.priority import DEFAULT_PRIORITY, HIGHEST, LEVELS, LOWEST, RANGE, Priority
from jobs.structured import vetted_problem

MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000
# JSON nested deeper than this is refused wherever it comes in (request bodies, batch lines, form fields): no
# request needs more, and Python's parser and pydantic's serializer fail (a 500) long before a client runs out
MAX_JSON_DEPTH = 64
FLOAT_DIGITS = 308  # an integer of more digits may be past a float's range (about 1.8e308)
# PostgreSQL text and jsonb cannot hold NUL: a string that is stored documents (and checks) that it has none
NO_NUL = r"^[^\x00]*$"


def error_message(error: dict) -> str:
    """A validation error's message for people: pydantic's, but for NUL, which it would show as a pattern."""
    if error.get("type") == "string_pattern_mismatch" and (error.get("ctx") or {}).get("pattern") == NO_NUL:
        return "must not contain NUL (\\u0000) characters"
    return error.get("msg", "invalid")


MAX_NEW_TOKENS = 4096
MAX_CHOICES = 8  # a job's `n`: OpenAI's allows more, but each choice holds KV blocks of its own
DEFAULT_MAX_NEW_TOKENS = 256
T = TypeVar("T")


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"  # its deadline passed before it finished (what it had generated is kept)


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.expired})


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


MAX_DEADLINE_S = 7 * 24 * 3600
DEFAULT_COMPLETION_WINDOW = "24h"


class Strict(BaseModel):
    # strict: a value of another JSON type is refused, not coerced (`false` is no seed, `0` no boolean), as the
    # OpenAPI document's types say
    model_config = ConfigDict(extra="forbid", strict=True)


class UnheldNumber(ValueError):
    """JSON that holds a number no float holds: what Python reads as NaN or infinity, stored as null (the job
    it was part of would fail when it is read back), or an integer past a float's range."""


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise UnheldNumber(f"the number {text[:40]} is out of a float's range")
    return value


def _int(text: str) -> int:
    value = int(text)
    if len(text) > FLOAT_DIGITS and abs(value) > sys.float_info.max:
        raise UnheldNumber(f"the number {text[:40]}... ({len(text)} digits) is out of a float's range")
    return value


def _constant(name: str) -> float:
    raise UnheldNumber(f"{name} is no JSON number")


def bounded_json(text: str | bytes) -> object:
    """`json.loads`, refusing (`ValueError`) what nests deeper than `MAX_JSON_DEPTH`, and (`UnheldNumber`) NaN,
    Infinity and numbers past a float's range."""
    too_deep = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=_constant)
    except RecursionError:
        raise ValueError(too_deep) from None
    brackets = (text.count("[") + text.count("{")) if isinstance(text, str) else (text.count(b"[") + text.count(b"{"))
    if brackets > MAX_JSON_DEPTH and _deeper_than(value, MAX_JSON_DEPTH):  # few brackets (most requests): no walk
        raise ValueError(too_deep)
    return value


def _deeper_than(value: object, limit: int) -> bool:
    pending = [(value, 1)]
    while pending:  # iteratively: the walk itself must not recurse
        node, depth = pending.pop()
        if isinstance(node, dict | list):
            if depth > limit:
                return True
            pending.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


MAX_TOOLS = 128  # OpenAI's bound on a request's tools
# OpenAI's pattern for a function's name
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolCallId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NO_NUL)]
Content = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CONTENT_CHARS, pattern=NO_NUL)]


class FunctionCall(Strict):
    name: ToolName
    arguments: str = Field(max_length=MAX_CONTENT_CHARS, pattern=NO_NUL, description="the arguments as JSON text")


class ToolCall(Strict):
    """A call an assistant message made (OpenAI's `message.tool_calls[]`), sent back with the conversation."""

    id: ToolCallId
    type: Literal["function"]
    function: FunctionCall


def _role_rules(schema: dict[str, Any]) -> None:
    """`Message._fields_of_role` in the OpenAPI document, so that a client (or a fuzzer) knows it: a system or
    user message has content, an assistant one content or tool calls, a tool one content and tool_call_id."""
    text = {"type": "string"}
    schema["oneOf"] = [
        {"properties": {"role": {"enum": ["system", "user"]}, "content": text, "tool_calls": {"type": "null"},
                        "tool_call_id": {"type": "null"}}, "required": ["role", "content"]},
        {"properties": {"role": {"const": "assistant"}, "tool_call_id": {"type": "null"}},
         "anyOf": [{"properties": {"content": text}, "required": ["content"]},
                   {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]}]},
        {"properties": {"role": {"const": "tool"}, "content": text, "tool_call_id": text,
                        "tool_calls": {"type": "null"}}, "required": ["role", "content", "tool_call_id"]},
    ]


class Message(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_role_rules)

    role: Literal["system", "user", "assistant", "tool"]
    content: Content | None = Field(None, description="required, but for an assistant message with tool_calls")
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="assistant: the tools it called")
    tool_call_id: ToolCallId | None = Field(None, description="tool (required there): the call this is the answer of")

    @model_validator(mode="before")
    @classmethod
    def _no_content_beside_calls(cls, data: object) -> object:
        # OpenAI's clients send an assistant turn that only called tools with content "" as often as with null
        if isinstance(data, dict) and data.get("tool_calls") and data.get("content") == "":
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _fields_of_role(self) -> Message:
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a message of role {self.role!r} needs content (only an assistant message that calls "
                             "tools may have none)")
        return self


UNSET = ("left unset, the model's generation_config.json decides (CONVOQ_GENERATION_CONFIG=auto), else "
         "convoq's default: ")


class Sampling(Strict):
    """Unset fields (None) take the model's own defaults from its generation_config.json, as `transformers`
    and vLLM do; with CONVOQ_GENERATION_CONFIG=none, or where the model says nothing, convoq's: greedy."""

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS,
                                description="output tokens at most, thinking included")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 means greedy; " + UNSET + "0")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=UNSET + "1")
    top_k: int | None = Field(None, ge=0, le=1000, description="0 means off; " + UNSET + "0")
    min_p: float | None = Field(None, ge=0.0, lt=1.0, description="drop tokens less likely than min_p times the "
                                "most likely one; " + UNSET + "0")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="> 1 makes tokens already in the "
                                             "prompt or output less likely; " + UNSET + "1")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="subtracted from the logit of every "
                                           "token already in the output; convoq's default: 0")
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]] = Field(
        default_factory=list, max_length=8)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# the windows of at most 7 days, as a pattern the OpenAPI document carries (window_seconds checks the same)
WINDOW_PATTERN = r"^([1-9][0-9]{0,4}s|[1-5][0-9]{5}s|60[0-3][0-9]{3}s|604[0-7][0-9]{2}s|604800s|[1-9][0-9]{0,3}m|100[0-7][0-9]m|10080m|[1-9][0-9]?h|1[0-5][0-9]h|16[0-8]h|[1-7]d)$"


def window_seconds(window: str) -> int:
    """A completion window in OpenAI's form (`"24h"`; also `"90s"`, `"30m"`, `"2d"`) in seconds."""
    match = re.fullmatch(r"([1-9]\d{0,6})([smhd])", window)
    if match is None:
        raise ValueError(f"completion_window {window!r} is not a window like '24h', '30m' or '2d'")
    seconds = int(match[1]) * WINDOW_UNITS[match[2]]
    if seconds > MAX_DEADLINE_S:
        raise ValueError(f"completion_window {window!r} is longer than {MAX_DEADLINE_S // 86400}d")
    return seconds


def _valid_window(window: str) -> str:
    window_seconds(window)
    return window


# a completion window: checked by `window_seconds` (its message names the problem), documented by the pattern
Window = Annotated[str, AfterValidator(_valid_window), WithJsonSchema({"type": "string", "pattern": WINDOW_PATTERN})]


Key = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w.:@/-]+$")]


MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def _valid_schema(schema: object) -> object:
    # before pydantic's own validation, which copies the dict: the object the API vetted (`jobs.structured.vet`)
    if isinstance(schema, dict) and (problem := vetted_problem(schema)):
        raise ValueError(problem)
    return schema


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`: the answer is JSON that validates against `schema`."""

    # `schema` is the wire name; a field of that name would shadow pydantic's `BaseModel.schema`
    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True, validate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    schema_: Annotated[dict[str, Any], BeforeValidator(_valid_schema)] = Field(
        alias="schema", description="a JSON schema (checked against its meta-schema; draft 2020-12 unless its "
                                    "`$schema` says otherwise)")
    strict: bool | None = Field(None, description="accepted for OpenAI's clients: the answer always follows the "
                                                  "schema, decoding is constrained by it")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's `response_format`; `jobs.structured.grammar_spec` makes it the engine's grammar
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class FunctionDefinition(Strict):
    name: ToolName
    description: str | None = Field(None, max_length=MAX_CONTENT_CHARS, pattern=NO_NUL)
    parameters: Annotated[dict[str, Any], BeforeValidator(_valid_schema)] | None = Field(
        None, description="the arguments' JSON schema; unset: any JSON object")
    strict: bool | None = Field(None, description="where a tool_choice forces a call, its arguments follow "
                                                  "`parameters`, or with false are any JSON object (OpenAI's)")


class Tool(Strict):
    """OpenAI's function tool: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# what a job gained after its first form (migration 0012: choices, structured outputs, logprobs, tools), each with a
# default of its own: a request that leaves them unset is the job it was before
LATER_OPTIONS = ("n", "response_format", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")


class JobIn(Strict):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    kind: Literal["chat", "summarize"] = "chat"
    priority: Priority = Field(DEFAULT_PRIORITY, description=f"{LOWEST}..{HIGHEST}, {HIGHEST} is the most urgent")
    conversation_id: Key | None = None
    idempotency_key: Key | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    thinking: bool | None = Field(
        None, description="let a thinking model (Qwen3) reason in a <think> block before it answers; the result "
                          "then holds the reasoning apart from the answer. Unset: off for `summarize`, "
                          "CONVOQ_DEFAULT_THINKING for `chat`")
    max_thinking_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="with thinking: once the reasoning is this long the block is "
                                                   "closed and the model answers (within max_new_tokens)")
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_DEADLINE_S,
        description="seconds after creation: not started by then, the job ends `expired` without running; "
                    "still running then, it is stopped and ends `expired` with the text it had",
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="answers to generate for the one prompt (OpenAI's `n`), "
                   "its KV computed once; with a seed, choice i samples with seed + i. Chat jobs only")
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: `json_object` or `json_schema` constrain the answer (after the reasoning, with "
                          "thinking) to JSON, decoded under a grammar so that it always parses and validates; a "
                          "summary's parts run free and its final summary is constrained")
    logprobs: bool = Field(False, description="the result carries each answer token's log-probability "
                                              "(OpenAI's `logprobs.content`)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: the most "
                                     "likely alternatives listed at each token (0..20; unset: none)")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="OpenAI's function tools the model may "
                                     "call (chat jobs): shown to it through its chat template")
    tool_choice: ToolChoice | None = Field(
        None, description="none (no tool is shown), auto (the model decides), required (it calls one or more), or "
                          "a named function (it calls that one); the last two are enforced by a grammar. Unset: "
                          "auto with tools, none without")
    parallel_tool_calls: bool = Field(True, description="false: the answer makes one call at most (a second is "
                                                        "text; enforced by the grammar under `required`)")

    @model_validator(mode="after")
    def _chat_ends_with_a_question(self) -> JobIn:
        if self.kind == "chat" and self.messages[-1].role not in ("user", "tool"):
            raise ValueError("a chat job's last message must have role 'user' or 'tool'")
        return self

    @model_validator(mode="after")
    def _tools_of_chats(self) -> JobIn:
        if self.kind == "summarize":
            if self.tools or self.tool_choice is not None:
                raise ValueError("tools are for chat jobs; a summarize job calls none")
            if any(m.content is None or m.role == "tool" for m in self.messages):
                raise ValueError("a transcript to summarize holds system, user and assistant turns with content")
            return self
        names = [tool.function.name for tool in self.tools or ()]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"tools: each function needs a name of its own; {', '.join(twice)} is given twice")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not among "
                             f"the tools ({', '.join(names) or 'none given'})")
        return self

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> JobIn:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _choices_of_chats(self) -> JobIn:
        # a summary's choices would be choices of its final combine only, the parts' text shared: not OpenAI's n
        if self.kind == "summarize" and self.n > 1:
            raise ValueError("n > 1 is for chat jobs; a summarize job has one summary")
        return self


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


class JobAccepted(BaseModel):
    id: UUID
    status: JobStatus
    created: bool = Field(description="false when the idempotency key matched an existing job")


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="-9999.0 stands for minus infinity (a token the grammar rules out), as in OpenAI's")
    bytes: list[int] = Field(description="the token's bytes (a character's may span tokens)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely tokens at this position, best first")


class ChoiceOut(BaseModel):
    """One answer: a job's result is its first (choice 0); a job with `n` > 1 lists the others in `choices`."""

    text: str = Field(description="the answer (with thinking, what follows the reasoning), without its tool calls")
    reasoning: str | None = Field(None, description="with thinking: the reasoning, without its <think> tags")
    completion_tokens: int = Field(description="every generated token, the reasoning's included; a result's: "
                                               "those of all its choices")
    finish_reason: str = Field(description="stop | length | tool_calls | cancelled | expired (the last two keep the "
                                           "text so far)")
    tool_calls: list[ToolCall] | None = Field(None, description="the tools the answer called (OpenAI's "
                                              "`message.tool_calls`), parsed out of its text")
    logprobs: list[TokenLogprob] | None = Field(None, description="when the job asked for logprobs: OpenAI's "
                                                "`logprobs.content`, one entry per token of the answer (with "
                                                "thinking, the tokens after the reasoning)")


class ResultOut(ChoiceOut):
    prompt_tokens: int = Field(description="counted once, however many choices share the prompt")
    choices: list[ChoiceOut] | None = Field(None, description="a job with n > 1: choices 1..n-1 (the result "
                                                              "itself is choice 0)")


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


class BatchStatus(enum.StrEnum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"  # its completion window ended with items unfinished (those items are `expired`)


BATCH_SETTLED = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.cancelled, BatchStatus.expired})


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


METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds on `metadata`
# OpenAI's `metadata`: at most 16 string keys of 64 characters, each with a string of at most 512
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=METADATA_KEY_CHARS, pattern=NO_NUL)],
         Annotated[str, StringConstraints(max_length=METADATA_VALUE_CHARS, pattern=NO_NUL)]],
    Field(max_length=METADATA_KEYS),
    # the keys' bounds as `propertyNames` (pydantic would write a `patternProperties` that lets other keys through)
    WithJsonSchema({"type": "object", "maxProperties": METADATA_KEYS,
                    "propertyNames": {"maxLength": METADATA_KEY_CHARS, "pattern": NO_NUL},
                    "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS, "pattern": NO_NUL}})]


def safe_metadata(stored: object) -> dict[str, str]:
    """Metadata as it may be shown, from whatever a row holds: rows stored before `Metadata` bounded it may hold
    anything JSON can; what does not fit the bounds is left out, never a reason for a read to fail."""
    if not isinstance(stored, dict):
        return {}
    kept = {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str) and "\x00" not in k + v
            and len(k) <= METADATA_KEY_CHARS and len(v) <= METADATA_VALUE_CHARS}
    return dict(list(kept.items())[:METADATA_KEYS])


PRIORITY_TEXTS = frozenset(str(p) for p in LEVELS)


def _priority_is_a_digit(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata and "priority" in metadata and metadata["priority"] not in PRIORITY_TEXTS:
        raise ValueError(f"metadata.priority must be a digit '{LOWEST}'..'{HIGHEST}' ({HIGHEST} most urgent), not "
                         f"{metadata['priority']!r}")
    return metadata


# OpenAI's `metadata`, in which a priority may ride as its digit
PriorityMetadata = Annotated[Metadata | None, AfterValidator(_priority_is_a_digit)]


def metadata_priority(metadata: dict[str, str] | None) -> int | None:
    return None if not metadata or "priority" not in metadata else int(metadata["priority"])


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


class FileOut(BaseModel):
    """OpenAI's File object. A batch's output and error files are files too (`purpose` `batch_output`)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "convoq"


class ListOf(BaseModel, Generic[T]):
    """OpenAI's list object; `after` (an id) and `limit` page through it."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
