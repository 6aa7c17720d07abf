"""OpenAI's response objects, built from ours: one place for what a `chat.completion` (and its chunks) holds."""

from __future__ import annotations

from datetime import datetime

from jobs.schemas import ResultOut
from jobs.tables import as_utc


def unix(moment: datetime) -> int:
    """A timestamp as OpenAI's objects carry it: Unix seconds."""
    return int(as_utc(moment).timestamp())


def usage(result: ResultOut) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def chat_completion(completion_id: str, created: int, model: str, result: ResultOut) -> dict:
    """A `chat.completion`; with thinking, the reasoning is the message's `reasoning_content` (vLLM's reasoning
    parser's convention)."""
    message = {"role": "assistant", "content": result.text}
    if result.reasoning is not None:
        message["reasoning_content"] = result.reasoning
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason}],
            "usage": usage(result)}


def chunk(completion_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    """One `chat.completion.chunk` of a streamed answer."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
