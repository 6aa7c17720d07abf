"""A job's progress as Server-Sent Events: its status, its text as it is generated, then its result.

The stream subscribes to the job's Redis channel (`jobs.broker.progress_channel`) *before* reading the
job's row, so nothing that happens in between is missed, and starts from that row: a client that connects
late gets the current status at once and the whole text so far with the next text event. The row is read
again whenever the channel is quiet for `poll_s`, so a lost event only delays the end, never hangs it.

Events (`event:` name, `data:` one JSON object, a `JobEvent`):
  status  {"event": "status", "status": "queued" | "running" | ...}
  text    {"event": "text", "text": <everything generated so far>, "tokens": n}
  result  {"event": "result", "job": <the job, as GET /v1/jobs/{id}>}   (the last event)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from uuid import UUID

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis

from jobs.broker import progress_channel
from jobs.schemas import TERMINAL, JobEvent, JobOut, JobStatus

KEEPALIVE_S = 15.0


def sse(event: JobEvent) -> bytes:
    return f"event: {event.event}\ndata: {event.model_dump_json(exclude_unset=True)}\n\n".encode()


async def job_events(redis: Redis, load: Callable[[UUID], JobOut | None], job_id: UUID,
                     poll_s: float = 1.0) -> AsyncIterator[bytes]:
    """The job's events as a Server-Sent Events stream, with a comment line every `KEEPALIVE_S` of quiet."""
    async for event in follow(redis, load, job_id, poll_s):
        yield b": keep-alive\n\n" if event is None else sse(event)


async def follow(redis: Redis, load: Callable[[UUID], JobOut | None], job_id: UUID,
                 poll_s: float = 1.0) -> AsyncIterator[JobEvent | None]:
    """The job's events (None: nothing happened for `KEEPALIVE_S`), ending with its `result`."""
    pubsub = redis.pubsub()
    await pubsub.subscribe(progress_channel(str(job_id)))
    try:
        if (job := await run_in_threadpool(load, job_id)) is None:
            return
        status = job.status
        yield JobEvent(event="status", status=status)
        quiet_since = last_sent = time.monotonic()
        while status not in TERMINAL:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=poll_s)
            now = time.monotonic()
            if message is not None:
                quiet_since = now
                event = json.loads(message["data"])
                if event["event"] == "text":
                    yield JobEvent(event="text", text=event["text"], tokens=event["tokens"])
                    last_sent = now
                    continue
                new = JobStatus(event["status"])
            elif now - quiet_since >= poll_s:  # quiet: the row tells whether an event was missed
                quiet_since = now
                row = await run_in_threadpool(load, job_id)
                if row is None:  # deleted with its batch
                    return
                new = row.status
            else:
                continue
            if new in TERMINAL:
                break
            if new != status:
                status = new
                yield JobEvent(event="status", status=status)
                last_sent = now
            elif now - last_sent >= KEEPALIVE_S:
                yield None
                last_sent = now
        # the row is final before its terminal event goes out
        if (job := await run_in_threadpool(load, job_id)) is None:
            return
        if job.status != status:
            yield JobEvent(event="status", status=job.status)
        yield JobEvent(event="result", job=job)
    finally:
        await pubsub.unsubscribe()
        await pubsub.aclose()
