"""`POST /v1/chat/completions`: OpenAI's chat endpoint over our queue, for interactive work.

The request becomes a job like any other (stored, published, run by a worker at its priority: interactive
unless the `X-Convoq-Priority` header or `metadata.priority` says otherwise) and the answer waits for it.
With `stream: true` the text comes as `chat.completion.chunk` events while it is generated (the job's
progress stream; with thinking, the reasoning as `delta.reasoning_content`). A client that goes away before
the answer cancels its job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Header, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from api.batch_input import OpenAIBody, openai_job
from api.deps import V1_ERRORS, Caller, CeleryDep, IntakeDep, SessionsDep, SettingsDep, errors
from api.errors import openai_error
from api.events import follow
from api.openai_objects import chat_completion, chunk, usage
from api.priority import chosen_priority
from api.service.jobs import cancel, enqueue, load
from jobs.chat import split_reasoning, thinking_of
from jobs.schemas import JobOut, JobStatus, PriorityMetadata, metadata_priority

router = APIRouter(prefix="/v1/chat", tags=["openai"], responses=V1_ERRORS)


class ChatCompletionRequest(OpenAIBody):
    model: str
    n: int = 1  # checked in the route: OpenAI answers a 400 for what it cannot do
    stream: bool = False
    stream_options: dict | None = None
    metadata: PriorityMetadata = None


async def _gone(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _finished(request: Request, events: AsyncIterator) -> JobOut | None:
    """The job once it finished, or None if the client went away first."""
    gone = asyncio.ensure_future(_gone(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
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


@router.post("/completions", responses={
    200: {"description": "A `chat.completion`, or with `stream` its `chat.completion.chunk`s as Server-Sent Events",
          "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}}},
    **errors(e400="A field we cannot honour", e404="The model is not served here",
             e409="The job was cancelled or expired", e500="The job failed")})
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    sessions: SessionsDep,
    celery: CeleryDep,
    settings: SettingsDep,
    intake: IntakeDep,
    caller: Caller,
    # typed `int` so the document says integer (a header is never JSON null); absent, it is None
    x_convoq_priority: Annotated[int, Header(  # noqa: RUF013
        ge=0, le=9, description="0..9, 9 most urgent; before `metadata.priority`; interactive by default")] = None,
):
    """OpenAI's chat completions (`n` = 1). Sampling fields as in a batch line; unset ones take the model's
    defaults. Answers a `chat.completion`, or with `stream` its chunks as Server-Sent Events."""
    if body.model != settings.model:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"model {body.model!r} is not served here; GET /v1/models "
                                                       "lists the one that is")
    if body.n != 1:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"n must be 1 (one choice per request), not {body.n}")
    try:
        priority = chosen_priority(x_convoq_priority, metadata_priority(body.metadata), settings.interactive_priority)
        job_in = openai_job(body, priority)
    except (ValueError, ValidationError) as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
    job_id = (await run_in_threadpool(enqueue, sessions, celery, settings, intake, caller, job_in)).id
    completion_id = f"chatcmpl-{job_id.hex}"
    events = follow(request.app.state.redis, lambda i: load(sessions, i, caller), job_id)

    def give_up() -> None:
        cancel(sessions, celery, job_id, caller)

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        deltas = Deltas(thinking_of(job_in, settings.default_thinking))
        return StreamingResponse(_stream(events, deltas, completion_id, body.model, include_usage, give_up),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    job = await _finished(request, events)
    if job is None:
        await run_in_threadpool(give_up)
        raise HTTPException(499, "the client went away; its job was cancelled")
    if job.status == JobStatus.failed:
        raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, f"the job failed: {job.error}")
    if job.status != JobStatus.succeeded:
        raise HTTPException(status.HTTP_409_CONFLICT, f"the job ended {job.status.value}: {job.error}")
    return chat_completion(completion_id, int(job.created_at.timestamp()), body.model, job.result)


def _data(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def _stream(events: AsyncIterator, deltas: Deltas, completion_id: str, model: str, include_usage: bool,
                  give_up) -> AsyncIterator[bytes]:
    created, finished = int(time.time()), False
    try:
        yield _data(chunk(completion_id, created, model, {"role": "assistant", "content": ""}))
        async for event in events:
            if event is None:
                yield b": keep-alive\n\n"
            elif event.event == "text" and (delta := deltas(event.text)):
                yield _data(chunk(completion_id, created, model, delta))
            elif event.event == "result":
                finished, job = True, event.job
                if job.status != JobStatus.succeeded:
                    code = 500 if job.status == JobStatus.failed else 409
                    yield _data({"error": openai_error(code, f"the job ended {job.status.value}: {job.error}")})
                    break
                result = job.result
                # the stored text is final (stop strings cut, the reasoning split off): send what is still missing
                final = f"<think>{result.reasoning}</think>{result.text}" if result.reasoning is not None else result.text
                if delta := deltas(final):
                    yield _data(chunk(completion_id, created, model, delta))
                yield _data(chunk(completion_id, created, model, {}, result.finish_reason))
                if include_usage:
                    yield _data({**chunk(completion_id, created, model, {}), "choices": [], "usage": usage(result)})
                break
        yield _data("[DONE]")
    finally:
        await events.aclose()
        if not finished:  # the client went away (the stream was cancelled): so does its job
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(give_up)
