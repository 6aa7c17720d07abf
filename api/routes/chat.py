"""`POST /v1/chat/completions`: OpenAI's chat endpoint over our queue, for interactive work.

The request becomes a job like any other (stored, published, run by a worker at its priority: interactive
unless the `X-Convoq-Priority` header or `metadata.priority` says otherwise) and the answer waits for it.
With `stream: true` the text comes as `chat.completion.chunk` events while it is generated (the job's
progress stream; with thinking, the reasoning as `delta.reasoning_content`; with `logprobs`, the answer's come
whole in the chunk that finishes it, as that stream carries text, not tokens; with tools, the text before the
first `<tool_call>` streams and the calls come parsed, each whole in a `delta.tool_calls` chunk, once the job
ended). A client that goes away before
the answer cancels its job. A waiting chat, streamed or not, counts as a stream against the bounds of
`api.streams.hub.Hub` (429 past them, before anything is stored).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError

from api.http.deps import V1_ERRORS, Caller, HubDep, IntakeDep, errors
from api.http.errors import CodedError
from api.http.json_body import BoundedJsonRoute
from api.http.priority import ChatPriorityHeader, chosen_priority
from api.schemas.chat_completion import chat_completion
from api.schemas.metadata import PriorityMetadata, metadata_priority
from api.service.batch_input import OpenAIBody, openai_job
from api.service.jobs import Unrunnable, cancel, enqueue, load
from api.streams.chat_stream import Deltas, chat_stream, finished, unsuccessful
from api.streams.events import EventStream, follow
from jobs.chat import thinking_of
from jobs.status import JobStatus
from jobs.tool_calls import stream_stops

router = APIRouter(prefix="/v1/chat", tags=["openai"], responses=V1_ERRORS, route_class=BoundedJsonRoute)


class ChatCompletionRequest(OpenAIBody):
    model: str
    stream: bool = False
    stream_options: dict | None = None
    metadata: PriorityMetadata = None


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
        return EventStream(chat_stream(events, deltas, completion_id, body.model, include_usage, give_up), release)
    try:
        job = await finished(request, events)
    finally:
        release()
    if job is None:
        await run_in_threadpool(give_up)
        raise HTTPException(499, "the client went away; its job was cancelled")
    if job.status != JobStatus.succeeded:
        raise CodedError(*unsuccessful(job))
    return chat_completion(completion_id, int(job.created_at.timestamp()), body.model, job.result)
