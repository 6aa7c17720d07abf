"""Reading a batch upload: JSONL lines in the OpenAI Batch format or our own, each validated on its own.

OpenAI lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {"messages", ...}}`.
Our lines: `{"custom_id", "transcript": [turns] | "text"}` (summarized) or `{"custom_id", "messages"}`
(answered as a chat), with optional sampling fields (flat, named as in `jobs.schemas.Sampling`), `thinking`,
`max_thinking_tokens`, `conversation_id`, `n` (chats), `response_format`, `logprobs`, `top_logprobs`, `tools`,
`tool_choice`, `parallel_tool_calls` (as in `jobs.schemas.JobIn`). OpenAI lines may say thinking as vLLM's
`chat_template_kwargs: {"enable_thinking": ...}`.
A bad line becomes a `LineError` with its number and reason; it never sinks the other lines. Lines are read from
the upload's bytes in whatever pieces they come (a stored file's chunks), one line in memory at a time: a line
longer than a request may be (`CONVOQ_MAX_REQUEST_BYTES`) is an error, its bytes skipped, never held.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.bounded_json import bounded_json
from jobs.schemas import LATER_OPTIONS, JobIn, Key, Sampling, error_message
from jobs.structured import SchemaBounds, within_bounds

log = logging.getLogger(__name__)

CHAT_COMPLETIONS = "/v1/chat/completions"
MAX_LINE_BYTES = 8 * 2**20  # as CONVOQ_MAX_REQUEST_BYTES by default: a line is one request
MAX_CUSTOM_ID = 255


@dataclass
class ParsedLine:
    line: int
    custom_id: str
    job: JobIn


@dataclass
class LineError:
    line: int
    custom_id: str | None
    message: str


class OpenAIBody(BaseModel):
    # every other option is kept (`model_extra`) for `openai_job` to refuse by name, unless it is `IGNORED` or off
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extensions of the request, which its clients send
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1  # the job checks it (`JobIn.n`)
    # the job checks these too (`JobIn`): a response_format's schema against JSON Schema's meta-schema
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # convoq's extensions: the turns of one conversation go to the worker that holds its prefix (`broker.affinity`);
    # a job's speculative decoding on or off (`jobs.schemas.Sampling.speculative`)
    conversation_id: Key | None = None
    speculative: str | None = None


# OpenAI's options that change nothing convoq answers, accepted and ignored on purpose (docs/openai.md says why)
IGNORED = frozenset({"model", "user", "store", "service_tier", "metadata"})
# what an option left at OpenAI's default is sent as: it asks for nothing
DEFAULTS: dict[str, Any] = {"stream": False}


def unsupported(body: OpenAIBody) -> list[str]:
    """The options of `body` convoq does not implement, by name: every one it does not know, but for those
    `IGNORED` and those set to nothing (null, false, empty) or to OpenAI's default."""
    return sorted(name for name, value in (body.model_extra or {}).items()
                  if name not in IGNORED and value not in (None, False, [], {}) and value != DEFAULTS.get(name))


# what OpenAI's body and our `Sampling` both name (`stop` too: a string is made a list): passed on as they are
SHARED_SAMPLING = tuple(name for name in Sampling.model_fields if name in OpenAIBody.model_fields)


def _text(content: Any) -> Any:
    """OpenAI content may be a list of parts; we take text parts only."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise ValueError("only text content parts are supported")
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _describe(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'line'}: {error_message(e)}" for e in exc.errors())


def _job_from_openai(obj: dict, priority: int) -> JobIn:
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, not {obj.get('method')!r}")
    if obj.get("url") != CHAT_COMPLETIONS:
        raise ValueError(f"url must be {CHAT_COMPLETIONS}, not {obj.get('url')!r}")
    return openai_job(OpenAIBody.model_validate(obj.get("body")), priority)


def openai_job(body: OpenAIBody, priority: int) -> JobIn:
    """A chat job from an OpenAI chat-completions request body (a batch line's, or `POST /v1/chat/completions`);
    a `ValueError` (or pydantic's `ValidationError`) says what it cannot run."""
    if names := unsupported(body):
        raise ValueError(f"not supported: {', '.join(names)} (convoq implements the options its OpenAI "
                         "compatibility page lists; the rest are refused rather than ignored)")
    sampling: dict[str, Any] = {name: value for name in SHARED_SAMPLING if (value := getattr(body, name)) is not None}
    max_new = body.max_completion_tokens or body.max_tokens
    if max_new is not None:
        sampling["max_new_tokens"] = max_new
    if body.frequency_penalty:  # it changes the output: never ignored silently
        raise ValueError("frequency_penalty is not supported; use presence_penalty or repetition_penalty")
    if isinstance(body.stop, str):
        sampling["stop"] = [body.stop]
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", None)
    if kwargs:
        raise ValueError(f"chat_template_kwargs may only hold enable_thinking, not {sorted(kwargs)}")
    messages = [{**m, "content": _text(m.get("content"))} for m in body.messages]
    return JobIn(messages=messages, kind="chat", priority=priority, sampling=sampling, thinking=thinking,
                 conversation_id=body.conversation_id, n=body.n, response_format=body.response_format,
                 logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs, tools=body.tools,
                 tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls)


def _job_from_ours(obj: dict, priority: int) -> JobIn:
    sampling = {k: obj[k] for k in Sampling.model_fields if k in obj}
    if "transcript" in obj:
        transcript = obj["transcript"]
        messages = [{"role": "user", "content": transcript}] if isinstance(transcript, str) else transcript
        kind = "summarize"
    elif "messages" in obj:
        messages, kind = obj["messages"], "chat"
    else:
        raise ValueError("a line needs `transcript`, `messages`, or an OpenAI `body`")
    return JobIn(messages=messages, kind=kind, priority=priority, sampling=sampling,
                 conversation_id=obj.get("conversation_id"), thinking=obj.get("thinking"),
                 max_thinking_tokens=obj.get("max_thinking_tokens"),
                 # the options with a default of their own: passed on only when a line sets them
                 **{k: obj[k] for k in LATER_OPTIONS if k in obj})


def split_lines(pieces: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """The lines (without their newline) of the bytes in `pieces`, which may split a line anywhere; None for a line
    over `max_line_bytes`, whose bytes are dropped as they come. Memory holds one piece and one line."""
    held = bytearray()
    over = False
    for piece in pieces:
        start = 0
        while True:
            end = piece.find(b"\n", start)
            part = piece[start:] if end < 0 else piece[start:end]
            if not over and len(held) + len(part) > max_line_bytes:
                over = True
                held.clear()
            elif not over:
                held += part
            if end < 0:
                break
            yield None if over else bytes(held)
            held.clear()
            over = False
            start = end + 1
    if held or over:
        yield None if over else bytes(held)


def count_lines(pieces: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES, stop_after: int | None = None) -> int:
    """Non-blank lines of the bytes in `pieces` (the requests `parse_lines` will find); past `stop_after` it stops
    reading and says `stop_after + 1`."""
    count = 0
    for line in split_lines(pieces, max_line_bytes):
        if line is None or line.strip():
            count += 1
            if stop_after is not None and count > stop_after:
                break
    return count


def parse_lines(pieces: Iterable[bytes], priority: int, max_line_bytes: int = MAX_LINE_BYTES,
                bounds: SchemaBounds | None = None) -> Iterator[ParsedLine | LineError]:
    """Each non-blank line of the bytes in `pieces` as a job or the reason it is not one, one line at a time; a
    line whose JSON schemas are past `bounds` is an error naming the bound. Memory holds one line and the
    custom_ids seen so far."""
    seen: set[str] = set()
    for number, raw in enumerate(split_lines(pieces, max_line_bytes), start=1):
        if raw is None:
            yield LineError(number, None, f"the line is longer than {max_line_bytes} bytes, the most a request may be")
            continue
        if not raw.strip():
            continue
        custom_id = None
        try:
            obj = bounded_json(raw.decode("utf-8"))
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID or "\x00" in custom_id:
                custom_id = None  # not one that can be stored, nor shown as the line's
                raise ValueError(f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters, "
                                 "without NUL")
            if custom_id in seen:
                raise ValueError(f"duplicate custom_id {custom_id!r}")
            if bounds is not None:
                within_bounds(obj.get("body") if "body" in obj else obj, bounds)
            job = (_job_from_openai if "body" in obj else _job_from_ours)(obj, priority)
        except UnicodeDecodeError:
            yield LineError(number, None, "line is not valid UTF-8")
        except json.JSONDecodeError as exc:
            yield LineError(number, None, f"invalid JSON: {exc.msg} at column {exc.colno}")
        except ValidationError as exc:
            yield LineError(number, custom_id, _describe(exc))
        except ValueError as exc:
            yield LineError(number, custom_id, str(exc))
        except Exception as exc:  # a line this code fails on is that line's error, never its batch's
            log.exception("line %d of a batch could not be read", number)
            yield LineError(number, custom_id, f"the line could not be read ({type(exc).__name__})")
        else:
            seen.add(custom_id)
            yield ParsedLine(number, custom_id, job)


def parse_batch(data: bytes, priority: int) -> tuple[list[ParsedLine], list[LineError], int]:
    """A whole upload in memory: valid lines, bad lines, and the number of non-blank lines."""
    parsed: list[ParsedLine] = []
    errors: list[LineError] = []
    for item in parse_lines([data], priority):
        (parsed if isinstance(item, ParsedLine) else errors).append(item)
    return parsed, errors, len(parsed) + len(errors)
