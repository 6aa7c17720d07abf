"""A job's progress as Server-Sent Events: its status, its text as it is generated, then its result.

The stream takes an inbox of the job's events from the process's `api.streams.hub.Hub` (subscribed *before* the
job's row is read, so nothing that happens in between is missed) and starts from that row: a client that
connects late gets the current status at once and the whole text so far with the next text event. The hub's
shared status poll stands in for lost events, so a lost event only delays the end, never hangs it.

The text a stream sends is always a prefix of what the job stores: it holds back what a stop string may still
cut (the stored text ends before it), a think tag still being written, and the bytes of a character not yet
complete. A job run again (handed back after a crash, or after its lease was lost) samples a new text: each
text event names its run, and when a new run's text does not go on from what was sent, or the stored result
does not, the stream ends with an `error` event instead (the client re-reads the job).

Events (`event:` name, `data:` one JSON object, a `JobEvent`):
  status  {"event": "status", "status": "queued" | "running" | ...}
  text    {"event": "text", "text": <everything generated so far>, "tokens": n}
  result  {"event": "result", "job": <the job, as GET /v1/jobs/{id}>}   (the last event)
  error   {"event": "error", "error": <what happened>}                   (the last event, instead of result)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from uuid import UUID

from fastapi.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.schemas.jobs import JobEvent, JobOut
from api.schemas.results import ResultOut
from api.streams.hub import Hub
from jobs.chat import split_reasoning
from jobs.status import TERMINAL, JobStatus

KEEPALIVE_S = 15.0
THINK_TAGS = ("<think>", "</think>")
RESTARTED = ("the job ran again (its worker was lost) and its new run wrote another text: the text streamed so "
             "far is void; read the job (GET /v1/jobs/{id}) for its result")


class EventStream(StreamingResponse):
    """A streamed response that gives its stream's place back (`release`) however it ends: sent, cut off by
    the client, or never started."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


def sse(event: JobEvent) -> bytes:
    return f"event: {event.event}\ndata: {event.model_dump_json(exclude_unset=True)}\n\n".encode()


async def job_events(hub: Hub, load: Callable[[UUID], JobOut | None], job_id: UUID,
                     stops: Sequence[str] = ()) -> AsyncIterator[bytes]:
    """The job's events as a Server-Sent Events stream, with a comment line every `KEEPALIVE_S` of quiet."""
    async for event in follow(hub, load, job_id, stops):
        yield b": keep-alive\n\n" if event is None else sse(event)


def settled(text: str, stops: Sequence[str]) -> str:
    """The part of `text` (a run's output so far) that its stored result is sure to begin with: it ends before
    the first stop string, before what may still become one or a think tag, and before the replacement
    characters of a character whose bytes have not all come."""
    end = len(text)
    for stop in stops:
        if (at := text.find(stop)) >= 0:
            end = min(end, at)
    for whole in (*stops, *THINK_TAGS):
        for n in range(min(len(whole) - 1, len(text)), 0, -1):
            if text.endswith(whole[:n]):
                end = min(end, len(text) - n)
                break
    return text[:end].rstrip("\ufffd")


def extends(before: str, after: str) -> bool:
    """Whether `after` goes on from `before`: as it is, or part by part once the reasoning is split off (the
    stored reasoning and answer are stripped, the streamed text is not)."""
    if after.startswith(before):
        return True
    reasoning, answer = split_reasoning(before)
    reasoning_after, answer_after = split_reasoning(after)
    return (reasoning is not None and reasoning_after is not None and reasoning_after.startswith(reasoning)
            and answer_after.startswith(answer))


def stored_text(result: ResultOut) -> str:
    """The stored result as one text, in the shape the stream sent it."""
    return result.text if result.reasoning is None else f"<think>{result.reasoning}</think>{result.text}"


class Restarted(Exception):
    """Another run's text does not go on from what the stream sent."""


class Sent:
    """The text a stream has sent and the run it came from."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = stops
        self.text = ""
        self.run: str | None = None
        self.left: set[str | None] = set()  # runs given up for a later one: their late events are stale

    def take(self, text: str, run: str | None) -> str | None:
        """The text to send now (it extends what was sent), None for nothing; raises `Restarted`."""
        text = settled(text, self.stops)
        if run != self.run and run in self.left:
            return None
        if run != self.run:
            if self.text and not (extends(self.text, text) or extends(text, self.text)):
                raise Restarted
            self.left.add(self.run)
            self.run = run
        if len(text) > len(self.text) and extends(self.text, text):
            self.text = text
            return text
        return None

    def matches(self, job: JobOut) -> bool:
        """Whether the stored result goes on from what was sent (a job without one has nothing to contradict)."""
        return job.result is None or extends(self.text, stored_text(job.result))


async def follow(hub: Hub, load: Callable[[UUID], JobOut | None], job_id: UUID, stops: Sequence[str] = (),
                 with_text: bool = True) -> AsyncIterator[JobEvent | None]:
    """The job's events (None: nothing was sent for `KEEPALIVE_S`), ending with its `result` (or `error`);
    without `with_text`, its status changes and result only."""
    async with hub.watch(job_id) as inbox:
        if (job := await run_in_threadpool(load, job_id)) is None:
            return
        hub.seen(job_id, job.status.value)
        status, sent = job.status, Sent(stops)
        yield JobEvent(event="status", status=status)
        last_sent, ended = time.monotonic(), status in TERMINAL
        while not ended:
            events = await inbox.take(KEEPALIVE_S - (time.monotonic() - last_sent))
            if not events:
                yield None
                last_sent = time.monotonic()
                continue
            for event in events:  # a terminal status ends the loop: what follows it is read from the row
                if event["event"] == "gone":  # deleted with its batch
                    return
                if event["event"] == "text":
                    if not with_text:
                        continue
                    try:
                        text = sent.take(event["text"], event.get("run"))
                    except Restarted:
                        yield JobEvent(event="error", error=RESTARTED.format(id=job_id))
                        return
                    if text is not None:
                        yield JobEvent(event="text", text=text, tokens=event["tokens"])
                        last_sent = time.monotonic()
                    continue
                new = JobStatus(event["status"])
                if new in TERMINAL:
                    ended = True
                    break
                if new != status:
                    status = new
                    yield JobEvent(event="status", status=status)
                    last_sent = time.monotonic()
        # the row is final before its terminal event goes out
        if (job := await run_in_threadpool(load, job_id)) is None:
            return
        if not sent.matches(job):
            yield JobEvent(event="error", error=RESTARTED.format(id=job_id))
            return
        if job.status != status:
            yield JobEvent(event="status", status=job.status)
        yield JobEvent(event="result", job=job)


async def wait_finished(hub: Hub, load: Callable[[UUID], JobOut | None], job_id: UUID,
                        wait_s: float) -> JobOut | None:
    """The job once it is terminal or `wait_s` passed (a long poll): read again only when its channel (or the
    hub's poll) says it ended, not on a timer. None once it is gone."""
    deadline = time.monotonic() + wait_s
    async with hub.watch(job_id) as inbox:
        job = await run_in_threadpool(load, job_id)
        if job is not None:
            hub.seen(job_id, job.status.value)
        while job is not None and job.status not in TERMINAL and (left := deadline - time.monotonic()) > 0:
            events = await inbox.take(left)
            if any(e["event"] == "gone" or e.get("status") in TERMINAL for e in events):
                job = await run_in_threadpool(load, job_id)
        return job
