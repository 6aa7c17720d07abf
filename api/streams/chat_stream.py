"""OpenAI's chat completions as the job's events deliver them: the answer once the job finished, or its text as
`chat.completion.chunk`s while it is generated (with thinking, the reasoning as `delta.reasoning_content`; with
`logprobs`, the answer's come whole in the chunk that finishes it; with tools, the calls come parsed once the job
ended)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import Request, status
from fastapi.concurrency import run_in_threadpool

from api.http.errors import openai_error
from api.schemas.chat_completion import chunk, logprobs, tool_call_deltas, usage
from api.schemas.jobs import JobOut
from api.streams.events import stored_text
from jobs.chat import split_reasoning
from jobs.error_codes import REQUEST_ERRORS
from jobs.status import JobStatus


async def _gone(request: Request) -> None:
    """Returns once the client went away: its body was read, so the next message can only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def finished(request: Request, events: AsyncIterator) -> JobOut | None:
    """The job once it finished, or None if the client went away first."""
    gone = asyncio.ensure_future(_gone(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.wait({step})  # the generator stops before it is closed below
                return None
            event = step.result()
            if event is not None and event.event == "result":
                return event.job
    finally:
        gone.cancel()
        await events.aclose()


class Deltas:
    """The new text of each progress event (they carry all of it so far), split into reasoning and answer
    when the job thinks."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.sent = {"reasoning_content": "", "content": ""}

    def __call__(self, text: str) -> dict:
        reasoning, answer = split_reasoning(text) if self.thinking else (None, text)
        delta = {}
        for name, now in (("reasoning_content", reasoning or ""), ("content", answer)):
            if now.startswith(self.sent[name]) and len(now) > len(self.sent[name]):
                delta[name], self.sent[name] = now[len(self.sent[name]):], now
        return delta


def unsuccessful(job: JobOut) -> tuple[int, str, str]:
    """The status, message and code that answer a job that did not succeed (its error as `load` shows it: a
    stable message and its code): one its request made fail (a prompt over the context, a schema the grammar
    compiler cannot take) is OpenAI's 400, a failure of the service a 500, a cancel or an expiry a 409."""
    if job.error_code in REQUEST_ERRORS:
        return status.HTTP_400_BAD_REQUEST, job.error, job.error_code
    if job.status != JobStatus.failed:
        return status.HTTP_409_CONFLICT, f"the job ended {job.status.value}: {job.error}", job.error_code
    return status.HTTP_500_INTERNAL_SERVER_ERROR, f"the job failed: {job.error}", job.error_code


def _data(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def chat_stream(events: AsyncIterator, deltas: Deltas, completion_id: str, model: str, include_usage: bool,
                      give_up: Callable[[], None]) -> AsyncIterator[bytes]:
    """The `chat.completion.chunk`s of a streamed answer as Server-Sent Events, then `[DONE]`; a client that goes
    away before the end gives its job up (`give_up`)."""
    created, finished = int(time.time()), False
    try:
        yield _data(chunk(completion_id, created, model, {"role": "assistant", "content": ""}))
        async for event in events:
            if event is None:
                yield b": keep-alive\n\n"
            elif event.event == "text" and (delta := deltas(event.text)):
                yield _data(chunk(completion_id, created, model, delta))
            elif event.event == "error":  # the job ran again: what was sent is not its answer
                finished = True
                yield _data({"error": openai_error(409, event.error, code="stream_restarted")})
                break
            elif event.event == "result":
                finished, job = True, event.job
                if job.status != JobStatus.succeeded:
                    http_status, message, error_code = unsuccessful(job)
                    yield _data({"error": openai_error(http_status, message, code=error_code)})
                    break
                result = job.result
                # the stored text is final (stop strings cut, the reasoning split off): send what is still missing
                if delta := deltas(stored_text(result)):
                    yield _data(chunk(completion_id, created, model, delta))
                if calls := tool_call_deltas(result):
                    yield _data(chunk(completion_id, created, model, {"tool_calls": calls}))
                # the progress events carry text, not tokens: the answer's logprobs come whole, with the finish
                yield _data(chunk(completion_id, created, model, {}, result.finish_reason, logprobs(result)))
                if include_usage:
                    yield _data({**chunk(completion_id, created, model, {}), "choices": [], "usage": usage(result)})
                break
        yield _data("[DONE]")
    finally:
        await events.aclose()
        if not finished:  # the client went away (the stream was cancelled): so does its job
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(give_up)
