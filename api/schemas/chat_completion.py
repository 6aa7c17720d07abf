"""OpenAI's response objects, built from ours: one place for what a `chat.completion` (and its chunks) holds."""

from __future__ import annotations

from datetime import datetime

from api.schemas.results import ChoiceOut, ResultOut
from jobs.tables import as_utc


def unix(moment: datetime) -> int:
    """A timestamp as OpenAI's objects carry it: Unix seconds."""
    return int(as_utc(moment).timestamp())


def usage(result: ResultOut) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def logprobs(answer: ChoiceOut) -> dict | None:
    """A choice's `logprobs`: null unless its job asked for them."""
    if answer.logprobs is None:
        return None
    return {"content": [token.model_dump() for token in answer.logprobs], "refusal": None}


def choice(index: int, answer: ChoiceOut) -> dict:
    """One of a `chat.completion`'s choices; with thinking, the reasoning is the message's `reasoning_content`
    (vLLM's reasoning parser's convention)."""
    message = {"role": "assistant", "content": answer.text}
    if answer.tool_calls:
        message["content"] = answer.text if answer.text.strip() else None  # OpenAI's null beside the calls alone
        message["tool_calls"] = [call.model_dump() for call in answer.tool_calls]
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    return {"index": index, "message": message, "logprobs": logprobs(answer), "finish_reason": answer.finish_reason}


def chat_completion(completion_id: str, created: int, model: str, result: ResultOut) -> dict:
    """A `chat.completion`: the result is choice 0, a job with `n` > 1 has its other choices after it."""
    answers = [result, *(result.choices or [])]
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice(i, answer) for i, answer in enumerate(answers)], "usage": usage(result)}


def tool_call_deltas(answer: ChoiceOut) -> list[dict]:
    """A streamed answer's `delta.tool_calls`: each call whole, with its `index` among them."""
    return [{"index": i, **call.model_dump()} for i, call in enumerate(answer.tool_calls or ())]


def chunk(completion_id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
          token_logprobs: dict | None = None) -> dict:
    """One `chat.completion.chunk` of a streamed answer; `token_logprobs` is its choice's `logprobs`."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": token_logprobs, "finish_reason": finish_reason}]}
