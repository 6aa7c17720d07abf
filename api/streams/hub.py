"""Every stream of one API process over one Redis pub/sub connection, and one status poll for all of them.

A connection per stream let a few thousand idle streams reach Redis's `maxclients` and take the broker from
the workers, and each quiet stream read its job's row every second. Here a dispatcher task reads the one
connection and hands each message to the inboxes of that job's followers; a job's channel is subscribed
when it gets its first follower and unsubscribed when it loses its last. Pub/sub drops what is published
while the connection is down, so every `poll_s` one query reads the status of every followed job and passes
on those that changed: its cost follows the followed jobs, not the quiet streams times a poll a second.

Streams are admitted here too: at most `max_streams_per_key` per API key and `max_streams` in all, past
either a 429 with Retry-After (`api.http.admission.Busy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable

from fastapi.concurrency import run_in_threadpool
from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.http.admission import Busy
from broker.redis_layout import progress_channel
from jobs.settings import Settings

log = logging.getLogger(__name__)

POLL_S = 5.0  # the safety net for lost pub/sub events: how late a missed status change is seen at worst
SUBSCRIBE_WAIT_S = 2.0  # a stream waits this long for Redis to confirm its channel, then relies on the poll
RETRY_S = 1.0  # after a Redis error, before the dispatcher tries the connection again


class Inbox:
    """What happened to one followed job since its stream last looked: events in order, consecutive text
    events coalesced (each carries all the text so far), so a slow client never piles them up."""

    def __init__(self) -> None:
        self._events: deque[dict] = deque()
        self._ready = asyncio.Event()

    def put(self, event: dict) -> None:
        if event.get("event") == "text" and self._events and self._events[-1].get("event") == "text":
            self._events[-1] = event
        else:
            self._events.append(event)
        self._ready.set()

    async def take(self, timeout: float) -> list[dict]:
        """The events waiting, once there is one or `timeout` passed ([] then)."""
        if not self._events:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        events = list(self._events)
        self._events.clear()
        return events


class Hub:
    """The streams of one API process (see above). `statuses(ids)` reads the status of each of those jobs (one
    left out was deleted); it runs in a worker thread."""

    def __init__(self, redis: Redis, statuses: Callable[[list[uuid.UUID]], dict[uuid.UUID, str]],
                 settings: Settings, poll_s: float = POLL_S) -> None:
        self.redis = redis
        self.pubsub = redis.pubsub()
        self.statuses = statuses
        self.poll_s = poll_s
        self.max_streams = settings.max_streams
        self.max_per_key = settings.max_streams_per_key
        self.retry_after_s = settings.busy_retry_after_s
        self._inboxes: dict[uuid.UUID, set[Inbox]] = {}
        self._known: dict[uuid.UUID, str] = {}  # the last status seen of each followed job
        self._subscribed: set[bytes] = set()  # channels SUBSCRIBE was sent for (and no UNSUBSCRIBE since)
        self._unconfirmed: Counter[bytes] = Counter()  # SUBSCRIBEs sent that Redis has not answered yet
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._changed = asyncio.Event()  # the followed jobs changed: subscribe or unsubscribe
        self._listening = asyncio.Event()  # something is subscribed: the dispatcher reads
        self._streams: Counter[str] = Counter()  # open streams by API key
        self._open = 0  # all of them: read by /metrics from another thread, so no iterating the Counter
        self._tasks: list[asyncio.Task] = []

    # --- admission -------------------------------------------------------------------------------------------

    @property
    def streams(self) -> int:
        return self._open

    def admit(self, key: str) -> Callable[[], None]:
        """Count a new stream of API key `key` (its hash), or raise `Busy` (429); returns its release, which
        may be called more than once."""
        if self.streams >= self.max_streams:
            raise Busy(f"this API process serves {self.max_streams} streams, its most; retry later",
                       self.retry_after_s)
        if self._streams[key] >= self.max_per_key:
            raise Busy(f"this API key has {self.max_per_key} streams open, its most; close one or retry later",
                       self.retry_after_s)
        self._streams[key] += 1
        self._open += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._open -= 1
                self._streams[key] -= 1
                if self._streams[key] <= 0:
                    del self._streams[key]

        return release

    # --- following -------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(self, job_id: uuid.UUID) -> AsyncIterator[Inbox]:
        """An inbox of the job's events, subscribed (Redis confirmed it, or `SUBSCRIBE_WAIT_S` passed) before
        it is handed out, so that a row read next misses nothing published after it."""
        self._start()
        inbox = Inbox()
        self._inboxes.setdefault(job_id, set()).add(inbox)
        self._changed.set()
        try:
            channel = _channel(job_id)
            if not self._is_confirmed(channel):
                confirmed = self._confirmed.setdefault(channel, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(confirmed.wait(), SUBSCRIBE_WAIT_S)
            yield inbox
        finally:
            followers = self._inboxes.get(job_id, set())
            followers.discard(inbox)
            if not followers:
                self._inboxes.pop(job_id, None)
                self._known.pop(job_id, None)
                self._changed.set()

    def seen(self, job_id: uuid.UUID, status: str) -> None:
        """A follower read the job's row: the poll passes on only what changes from here."""
        if job_id in self._inboxes:
            self._known[job_id] = status

    def _is_confirmed(self, channel: bytes) -> bool:
        return channel in self._subscribed and not self._unconfirmed[channel]

    def _answered(self, channel: bytes) -> None:
        """One SUBSCRIBE of `channel` answered (or never sent); a reconnection's own SUBSCRIBEs count nothing."""
        if self._unconfirmed[channel] > 1:
            self._unconfirmed[channel] -= 1
        else:
            self._unconfirmed.pop(channel, None)

    def _deliver(self, job_id: uuid.UUID, event: dict) -> None:
        if job_id not in self._inboxes:  # its last follower left (its channel is on its way out)
            return
        if event.get("event") == "status":
            self._known[job_id] = event["status"]
        for inbox in self._inboxes[job_id]:
            inbox.put(event)

    # --- the tasks -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        """Started on first use, on the loop that serves the requests (an app run without its lifespan too)."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(task(), name=f"hub.{task.__name__}")
                           for task in (self._sync, self._dispatch, self._poll)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.pubsub.aclose()
        await self.redis.aclose()

    async def _sync(self) -> None:
        """Subscribe the channels of newly followed jobs and unsubscribe those nobody follows, in one command
        each (thousands of streams opening at once are a handful of commands)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            wanted = {_channel(job_id) for job_id in self._inboxes}
            drop, add = self._subscribed - wanted, wanted - self._subscribed
            try:
                if drop:
                    await self.pubsub.unsubscribe(*drop)
                    self._subscribed -= drop
                    for channel in drop:
                        self._confirmed.pop(channel, None)
                if add:
                    self._unconfirmed.update(add)
                    await self.pubsub.subscribe(*add)
                    self._subscribed |= add
                    self._listening.set()
            except (RedisError, OSError) as exc:
                for channel in add - self._subscribed:
                    self._answered(channel)
                log.warning("streams: cannot (un)subscribe (%s); the status poll covers meanwhile", exc)
                await asyncio.sleep(RETRY_S)
                self._changed.set()

    async def _dispatch(self) -> None:
        """Read the pub/sub connection and route each message to its job's inboxes."""
        while True:
            if not self.pubsub.subscribed:
                self._listening.clear()
                await self._listening.wait()
                continue
            try:
                message = await self.pubsub.get_message(timeout=None)
            except (RedisError, OSError) as exc:
                log.warning("streams: pub/sub connection lost (%s); the status poll covers meanwhile", exc)
                await asyncio.sleep(RETRY_S)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if message["type"] == "subscribe":
                self._answered(channel)
                if self._is_confirmed(channel) and (confirmed := self._confirmed.pop(channel, None)):
                    confirmed.set()
            elif message["type"] == "message":
                try:
                    event = json.loads(message["data"])
                except ValueError:
                    continue
                self._deliver(_job_id(channel), event)

    async def _poll(self) -> None:
        """Every `poll_s`: the status of every followed job in one read, passed on where it changed."""
        while True:
            await asyncio.sleep(self.poll_s)
            followed = list(self._inboxes)
            if not followed:
                continue
            try:
                found = await run_in_threadpool(self.statuses, followed)
            except Exception as exc:  # the database is away: the streams wait for it, as they would anyway
                log.warning("streams: cannot read the followed jobs' statuses (%s)", type(exc).__name__)
                continue
            for job_id in followed:
                status = found.get(job_id)
                if status is None:
                    self._deliver(job_id, {"event": "gone"})
                elif status != self._known.get(job_id):
                    self._deliver(job_id, {"event": "status", "status": status})


def _channel(job_id: uuid.UUID) -> bytes:
    return progress_channel(str(job_id)).encode()


def _job_id(channel: bytes) -> uuid.UUID:
    return uuid.UUID(channel.decode().rpartition(":")[2])
