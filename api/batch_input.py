"""Reading a batch upload: JSONL lines in the OpenAI Batch format or our own, each validated on its own.

OpenAI lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {"messages", ...}}`.
Our lines: `{"custom_id", "transcript": [turns] | "text"}` (summarized) or `{"custom_id", "messages"}`
(answered as a chat), with optional sampling fields (flat, named as in `jobs.schemas.Sampling`), `thinking`,
`max_thinking_tokens`, `conversation_id`. OpenAI lines may say thinking as vLLM's
`chat_template_kwargs: {"enable_thinking": ...}`.
A bad line becomes a `LineError` with its number and reason; it never sinks the other lines.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.schemas import JobIn, Sampling

CHAT_COMPLETIONS = "/v1/chat/completions"


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
    # unknown OpenAI options (model, user, logprobs, ...) are accepted and ignored, as other servers do
    model_config = ConfigDict(extra="ignore")

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
    n: int = Field(1, ge=1, le=1, description="one choice per request")


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
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'line'}: {e['msg']}" for e in exc.errors())


def _job_from_openai(obj: dict, priority: int) -> JobIn:
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, not {obj.get('method')!r}")
    if obj.get("url") != CHAT_COMPLETIONS:
        raise ValueError(f"url must be {CHAT_COMPLETIONS}, not {obj.get('url')!r}")
    return openai_job(OpenAIBody.model_validate(obj.get("body")), priority)


def openai_job(body: OpenAIBody, priority: int) -> JobIn:
    """A chat job from an OpenAI chat-completions request body (a batch line's, or `POST /v1/chat/completions`);
    a `ValueError` (or pydantic's `ValidationError`) says what it cannot run."""
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
    return JobIn(messages=messages, kind="chat", priority=priority, sampling=sampling, thinking=thinking)


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
                 max_thinking_tokens=obj.get("max_thinking_tokens"))


def parse_lines(source: Iterable[bytes], priority: int) -> Iterator[ParsedLine | LineError]:
    """Each non-blank line of `source` (a binary file, read one line at a time) as a job or the reason it is
    not one. Memory holds one line and the custom_ids seen so far."""
    seen: set[str] = set()
    for number, raw in enumerate(source, start=1):
        if not raw.strip():
            continue
        custom_id = None
        try:
            obj = json.loads(raw.decode("utf-8"))
            if not isinstance(obj, dict):
                raise ValueError("a line must be a JSON object")
            custom_id = obj.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255:
                custom_id = custom_id if isinstance(custom_id, str) else None
                raise ValueError("custom_id must be a non-empty string of at most 255 characters")
            if custom_id in seen:
                raise ValueError(f"duplicate custom_id {custom_id!r}")
            job = (_job_from_openai if "body" in obj else _job_from_ours)(obj, priority)
        except UnicodeDecodeError:
            yield LineError(number, None, "line is not valid UTF-8")
        except json.JSONDecodeError as exc:
            yield LineError(number, None, f"invalid JSON: {exc.msg} at column {exc.colno}")
        except ValidationError as exc:
            yield LineError(number, custom_id, _describe(exc))
        except ValueError as exc:
            yield LineError(number, custom_id, str(exc))
        else:
            seen.add(custom_id)
            yield ParsedLine(number, custom_id, job)


def parse_batch(data: bytes, priority: int) -> tuple[list[ParsedLine], list[LineError], int]:
    """A whole upload in memory: valid lines, bad lines, and the number of non-blank lines."""
    parsed: list[ParsedLine] = []
    errors: list[LineError] = []
    for item in parse_lines(io.BytesIO(data), priority):
        (parsed if isinstance(item, ParsedLine) else errors).append(item)
    return parsed, errors, len(parsed) + len(errors)
