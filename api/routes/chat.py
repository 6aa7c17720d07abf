"""`POST /v1/chat/completions`: OpenAI's chat endpoint over our queue, for interactive work.

The request becomes a job like any other (stored, published, run by a worker at its priority: interactive
unless the `X-Convoq-Priority` header or `metadata.priority` says otherwise) and the answer waits for it.
With `stream: true` the text comes as `chat.completion.chunk` events while it is generated (the job's
progress stream; with thinking, the reasoning as `delta.reasoning_content`; with `logprobs`, the answer's come
whole in the chunk that finishes it, as that stream carries text, not tokens; with tools, the text before the
first `<tool_call>` streams and the calls come parsed, each whole in a `delta.tool_calls` chunk, once the job
ended). A client that goes away before
the answer cancels its job. A waiting chat, streamed or not, counts as a stream against the bounds of
`api.hub.Hub` (429 past them, before anything is stored).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from api.batch_input import OpenAIBody, openai_job
from api.deps import V1_ERRORS, Caller, HubDep, IntakeDep, errors
from api.errors import CodedError, openai_error
from api.events import EventStream, follow, stored_text
from api.json_body import BoundedJsonRoute
from api.priority import ChatPriorityHeader, chosen_priority
from api.schemas.chat_completion import chat_completion, chunk, logprobs, tool_call_deltas, usage
from api.schemas.jobs import JobOut
from api.schemas.metadata import PriorityMetadata, metadata_priority
from api.service.jobs import Unrunnable, cancel, enqueue, load
from jobs.chat import split_reasoning, thinking_of
from jobs.error_codes import REQUEST_ERRORS
from jobs.status import JobStatus
from jobs.tool_calls import stream_stops

router = APIRouter(prefix="/v1/chat", tags=["openai"], responses=V1_ERRORS, route_class=BoundedJsonRoute)


class ChatCompletionRequest(OpenAIBody):
    model: str
    stream: bool = False
    stream_options: dict | None = None
    metadata: PriorityMetadata = None


async def _gone(request: Request) -> None:
    """Returns once the client went away: its body was read, so the next message can only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _finished(request: Request, events: AsyncIterator) -> JobOut | None:
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


@router.post("/completions", responses={
    200: {"description": "A `chat.completion`, or with `stream` its `chat.completion.chunk`s as Server-Sent Events",
          "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}}},
    **errors(e400="A field we cannot honour, a prompt the model cannot take (too long, or refused by its chat "
                  "template), or a response_format schema that is invalid or that the grammar compiler cannot "
                  "take", e404="The model is not served here",
             e409="The job was cancelled or expired", e500="The job failed",
             e429="Rate limited, too many unfinished jobs, or too many streams of this key or of this process "
                  "(CONVOQ_MAX_STREAMS_PER_KEY, CONVOQ_MAX_STREAMS; see Retry-After)")})
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    intake: IntakeDep,
    hub: HubDep,
    caller: Caller,
    x_convoq_priority: ChatPriorityHeader = None,
):
    """OpenAI's chat completions (`n` up to 8; with `stream`, 1). Sampling fields as in a batch line; unset ones
    take the model's defaults. Answers a `chat.completion`, or with `stream` its chunks as Server-Sent Events."""
    settings, sessions, celery = intake.settings, intake.sessions, intake.celery
    if body.model != settings.model:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"model {body.model!r} is not served here; GET /v1/models "
                                                       "lists the one that is")
    if body.stream and body.n > 1:  # a job's progress events follow one text: its choice 0's
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"stream takes n = 1 only, not {body.n}: ask for the "
                                                         "choices without stream")
    try:
        priority = chosen_priority(x_convoq_priority, metadata_priority(body.metadata), settings.interactive_priority)
        job_in = openai_job(body, priority)
    except (ValueError, ValidationError) as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
    release = hub.admit(caller.digest)  # before anything is stored: a refused chat leaves no job behind
    try:
        job_id = (await run_in_threadpool(enqueue, intake, caller, job_in)).id
    except Unrunnable as exc:  # a prompt the model cannot take is OpenAI's 400
        release()
        raise HTTPException(status.HTTP_400_BAD_REQUEST, exc.message) from exc
    except BaseException:
        release()
        raise
    completion_id = f"chatcmpl-{job_id.hex}"
    stops = stream_stops(job_in.sampling.stop, job_in.tools, job_in.tool_choice)
    events = follow(hub, lambda i: load(sessions, i, caller), job_id, stops, with_text=body.stream)

    def give_up() -> None:
        cancel(sessions, celery, job_id, caller)

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        deltas = Deltas(thinking_of(job_in, settings.default_thinking))
        return EventStream(_stream(events, deltas, completion_id, body.model, include_usage, give_up), release)
    try:
        job = await _finished(request, events)
    finally:
        release()
    if job is None:
        await run_in_threadpool(give_up)
        raise HTTPException(499, "the client went away; its job was cancelled")
    if job.status != JobStatus.succeeded:
        raise CodedError(*_unsuccessful(job))
    return chat_completion(completion_id, int(job.created_at.timestamp()), body.model, job.result)


def _unsuccessful(job: JobOut) -> tuple[int, str, str]:
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
            elif event.event == "error":  # the job ran again: what was sent is not its answer
                finished = True
                yield _data({"error": openai_error(409, event.error, code="stream_restarted")})
                break
            elif event.event == "result":
                finished, job = True, event.job
                if job.status != JobStatus.succeeded:
                    http_status, message, error_code = _unsuccessful(job)
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
