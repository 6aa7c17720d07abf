"""Event streams and waiting chats against an API served by uvicorn in this process (real sockets, PostgreSQL
and Redis; no worker: the tests publish the progress events a worker would). Many streams share one Redis
connection and one status poll, their number is bounded, and the text a client is sent always goes on into
the stored result, or the stream ends with an error."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis
import uvicorn
from sqlalchemy import Engine, event

from api.app import create_app
from broker.redis_layout import progress_channel
from cli.servers import free_port
from jobs.settings import Settings
from jobs.status import JobStatus
from tests.api_keys import API_KEY, OTHER_KEY, auth
from tests.service_settings import settings_for
from tests.sql import sql
from worker.progress import ProgressPublisher

CHAT = {"messages": [{"role": "user", "content": "Where is my parcel?"}], "priority": 9}


@contextmanager
def served(settings: Settings) -> Iterator[tuple[object, str]]:
    """The API on a free loopback port, served by uvicorn on a thread of this process: (the app, its URL)."""
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API did not start"
        time.sleep(0.05)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def finish(database: str, job_id: str, text: str, reasoning: str | None = None) -> None:
    """Store the job's result as its worker would (the API is told by the status event that follows)."""
    sql(database, "UPDATE jobs SET status = 'succeeded', started_at = now(), finished_at = now() WHERE id = :id",
        id=job_id)
    sql(database, "INSERT INTO results (job_id, text, reasoning, prompt_tokens, completion_tokens, finish_reason, "
                  "created_at) VALUES (:id, :text, :reasoning, 5, 7, 'stop', now())",
        id=job_id, text=text, reasoning=reasoning)


def publish(broker: str, job_id: str, **event) -> None:
    client = redis.Redis.from_url(broker)
    client.publish(progress_channel(job_id), json.dumps(event))
    client.close()


async def subscribed(broker: str, job_id: str, timeout: float = 15.0) -> None:
    """Until the API listens to the job's channel: an event published before that is nobody's."""
    client = redis.Redis.from_url(broker)
    deadline = time.monotonic() + timeout
    try:
        while not client.pubsub_numsub(progress_channel(job_id))[0][1]:
            assert time.monotonic() < deadline, f"the API never subscribed to job {job_id}"
            await asyncio.sleep(0.02)
    finally:
        client.close()


def redis_clients(broker: str) -> int:
    client = redis.Redis.from_url(broker)
    try:
        return client.info("clients")["connected_clients"] - 1  # not this one
    finally:
        client.close()


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str | None, object]]:
    """(event name, parsed data) of each event; chat completion chunks have no name, `[DONE]` is a string."""
    name = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield name, data if data == "[DONE]" else json.loads(data)
            name = None


async def next_event(events: AsyncIterator, timeout: float = 15.0) -> tuple[str | None, object]:
    return await asyncio.wait_for(anext(events), timeout)


async def submit(client: httpx.AsyncClient, n: int, key: str = API_KEY) -> list[str]:
    ids = []
    for _ in range(n):
        r = await client.post("/v1/jobs", json=CHAT, headers=auth(key))
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    return ids


def test_idle_streams_share_one_redis_connection_and_one_status_poll(database, broker, tiny_model):
    n = 40
    statements = []

    def count(*_):
        statements.append(time.monotonic())

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=n + 10)) as client:
            ids = await submit(client, n)  # no worker: they stay queued, their streams quiet
            before = redis_clients(broker)
            async with Streams(client, [f"/v1/jobs/{i}/events" for i in ids]) as streams:
                for events in streams:
                    assert await next_event(events) == ("status", {"event": "status", "status": "queued"})
                assert redis_clients(broker) <= before + 1  # one pub/sub connection for all of them

                event.listen(Engine, "before_cursor_execute", count)
                try:
                    await asyncio.sleep(6)  # quiet: no row is read per stream
                finally:
                    event.remove(Engine, "before_cursor_execute", count)
                assert len(statements) <= 4, f"{len(statements)} statements for {n} quiet streams in 6 s"

                # an event reaches its own job's stream, and no other
                publish(broker, ids[3], event="status", status="running")
                assert await next_event(streams[3]) == ("status", {"event": "status", "status": "running"})
                with pytest.raises(TimeoutError):
                    await next_event(streams[4], timeout=1)

                # a status change whose event was lost is found by the shared poll
                sql(database, "UPDATE jobs SET status = 'cancelled', finished_at = now() WHERE id = :id", id=ids[5])
                assert (await next_event(streams[5], timeout=10))[1]["status"] == "cancelled"
                name, last = await next_event(streams[5])
                assert name == "result" and last["job"]["status"] == "cancelled"

    with served(settings_for(database, broker, tiny_model)) as (_, url):
        asyncio.run(scenario(url))


class Streams:
    """Open GET streams at these paths (all at once), each as an iterator of its events; closed on exit."""

    def __init__(self, client: httpx.AsyncClient, paths: list[str], key: str = API_KEY) -> None:
        self.client, self.paths, self.key = client, paths, key
        self.responses: list[httpx.Response] = []

    async def __aenter__(self) -> list[AsyncIterator]:
        async def one(path: str) -> httpx.Response:
            response = await self.client.send(self.client.build_request("GET", path, headers=auth(self.key)),
                                              stream=True)
            assert response.status_code == 200, (await response.aread()).decode()
            return response

        self.responses = await asyncio.gather(*(one(p) for p in self.paths))
        return [sse(r) for r in self.responses]

    async def __aexit__(self, *exc: object) -> None:
        for response in self.responses:
            await response.aclose()


def test_streams_past_their_bounds_are_refused_with_retry_after(database, broker, tiny_model):
    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            mine, others = await submit(client, 4), await submit(client, 3, OTHER_KEY)
            async with Streams(client, [f"/v1/jobs/{i}/events" for i in mine[:3]]):
                # a stream admitted would never end: a refusal answers at once
                r = await asyncio.wait_for(client.get(f"/v1/jobs/{mine[3]}/events", headers=auth()), 10)
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
                r = await asyncio.wait_for(client.post("/v1/chat/completions", headers=auth(), json={
                    "model": str(tiny_model), "messages": CHAT["messages"], "stream": True}), 10)
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                # a long poll holds a subscription too
                r = await asyncio.wait_for(client.get(f"/v1/jobs/{mine[3]}", params={"wait": 20}, headers=auth()), 10)
                assert r.status_code == 429, r.text
                async with Streams(client, [f"/v1/jobs/{i}/events" for i in others[:2]], OTHER_KEY):
                    r = await asyncio.wait_for(client.get(f"/v1/jobs/{others[2]}/events", headers=auth(OTHER_KEY)),
                                               10)
                    assert r.status_code == 429, "5 streams in all is this process's bound"
                    metrics = (await client.get("/metrics")).text
                    assert "convoq_api_streams 5.0" in metrics
            # closed streams give their places back
            async with Streams(client, [f"/v1/jobs/{i}/events" for i in mine[1:]]) as streams:
                assert (await next_event(streams[0]))[0] == "status"
        queued = sql(database, "SELECT count(*) FROM jobs")[0][0]
        assert queued == 7, "a refused chat stores no job"

    with served(settings_for(database, broker, tiny_model, max_streams_per_key=3, max_streams=5)) as (app, url):
        asyncio.run(scenario(url))
        document = app.openapi()
    for path, method in (("/v1/jobs/{job_id}/events", "get"), ("/v1/chat/completions", "post")):
        assert "429" in document["paths"][path][method]["responses"]


def test_a_rerun_that_writes_another_text_ends_the_streams_with_an_error(database, broker, tiny_model):
    """A job handed back and run again (sampling on) writes a new text: what the client was sent must stay a
    prefix of what is stored, or the client must be told."""

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # /events: the second run's text does not go on from the first's
            (job,) = await submit(client, 1)
            async with Streams(client, [f"/v1/jobs/{job}/events"]) as (events,):
                await next_event(events)
                run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
                publish(broker, job, event="status", status="running")
                publish(broker, job, event="text", text="Hello wor", tokens=3, run=run_a)
                assert (await next_event(events))[1] == {"event": "status", "status": "running"}
                assert (await next_event(events))[1]["text"] == "Hello wor"
                publish(broker, job, event="status", status="queued")
                publish(broker, job, event="text", text="Goodbye", tokens=2, run=run_b)
                assert (await next_event(events))[1] == {"event": "status", "status": "queued"}
                name, data = await next_event(events)
                assert name == "error" and "ran again" in data["error"]
                with pytest.raises(StopAsyncIteration):
                    await next_event(events)

            # a streamed chat whose stored result is another run's text than the one it was sent
            async with client.stream("POST", "/v1/chat/completions", headers=auth(), json={
                    "model": str(tiny_model), "messages": CHAT["messages"], "stream": True}) as response:
                chunks = sse(response)
                _, first = await next_event(chunks)
                job = str(uuid.UUID(first["id"].removeprefix("chatcmpl-")))
                await subscribed(broker, job)  # the first chunk may go out before the subscription is in place
                publish(broker, job, event="text", text="Hello wor", tokens=3, run=str(uuid.uuid4()))
                assert (await next_event(chunks))[1]["choices"][0]["delta"] == {"content": "Hello wor"}
                finish(database, job, "Goodbye all")
                publish(broker, job, event="status", status="succeeded")
                _, data = await next_event(chunks)
                assert data["error"]["code"] == "stream_restarted", data

    with served(settings_for(database, broker, tiny_model)) as (_, url):
        asyncio.run(scenario(url))


def test_streamed_text_is_always_a_prefix_of_the_stored_result(database, broker, tiny_model):
    """Stop strings the stored result is cut at, a character whose bytes are still coming, a think tag being
    written, and a rerun that writes the same text again: the deltas add up to the stored answer."""

    async def chat(client: httpx.AsyncClient, progress: list[dict], stored: str, reasoning: str | None = None,
                   **extra) -> tuple[str, str, str | None]:
        sent = {"content": "", "reasoning_content": ""}
        async with client.stream("POST", "/v1/chat/completions", headers=auth(), json={
                "model": str(tiny_model), "messages": CHAT["messages"], "stream": True, **extra}) as response:
            chunks = sse(response)
            _, first = await next_event(chunks)
            job = str(uuid.UUID(first["id"].removeprefix("chatcmpl-")))
            for text in progress:
                publish(broker, job, event="text", tokens=1, **text)
            await asyncio.sleep(0.5)
            finish(database, job, stored, reasoning)
            publish(broker, job, event="status", status="succeeded")
            finish_reason = None
            async for _, data in chunks:
                if data == "[DONE]":
                    break
                assert "error" not in data, data
                choice = data["choices"][0]
                for name, part in choice["delta"].items():
                    if name in sent:
                        sent[name] += part or ""
                finish_reason = choice["finish_reason"] or finish_reason
        return sent["content"], sent["reasoning_content"], finish_reason

    async def scenario(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
            content, _, reason = await chat(
                client, [{"text": "Hi thereEN", "run": run_a}, {"text": "Hi thereEND and mo", "run": run_a}],
                "Hi there", stop=["END"])
            assert (content, reason) == ("Hi there", "stop")
            content, _, _ = await chat(
                client, [{"text": "Bonjour caf\ufffd", "run": run_a}, {"text": "Bonjour café", "run": run_a}],
                "Bonjour café!")
            assert content == "Bonjour café!"
            content, _, _ = await chat(  # a greedy rerun: its shorter text is no contradiction
                client, [{"text": "Same words", "run": run_a}, {"text": "Same", "run": run_b},
                         {"text": "Same words again", "run": run_b}], "Same words again.")
            assert content == "Same words again."
            content, reasoning, _ = await chat(
                client, [{"text": "<think>\nwhy</thi", "run": run_a}, {"text": "<think>\nwhy\n</think>\n\nBe", "run": run_a}],
                "Because.", reasoning="why", chat_template_kwargs={"enable_thinking": True})
            assert (reasoning, content) == ("why", "Because.")

    with served(settings_for(database, broker, tiny_model)) as (_, url):
        asyncio.run(scenario(url))


def test_progress_events_name_the_run_they_come_from(redis_url):
    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return " ".join(map(str, ids))

    job, lease = str(uuid.uuid4()), uuid.uuid4()
    listener = redis.Redis.from_url(redis_url).pubsub()
    listener.subscribe(progress_channel(job))
    assert listener.get_message(timeout=5)["type"] == "subscribe"
    publisher = ProgressPublisher(redis_url, Tokenizer(), interval=0.05)
    try:
        publisher.tokens(job, [1, 2, 3], lease)
        message = None
        deadline = time.monotonic() + 5
        while message is None and time.monotonic() < deadline:
            message = listener.get_message(timeout=1)
    finally:
        publisher.close()
        listener.close()
    assert json.loads(message["data"]) == {"event": "text", "text": "1 2 3", "tokens": 3, "run": str(lease)}


def test_progress_is_published_only_for_jobs_someone_follows(redis_url):
    tag = uuid.uuid4().hex
    followed, unfollowed = f"{tag}-followed", f"{tag}-unfollowed"
    client = redis.Redis.from_url(redis_url)
    listener, everything = client.pubsub(), client.pubsub()
    listener.subscribe(progress_channel(followed))
    # a pattern subscription is not a follower (PUBSUB NUMSUB counts channels): it sees whatever is published
    everything.psubscribe(progress_channel(f"{tag}-*"))
    assert listener.get_message(timeout=5)["type"] == "subscribe"
    assert everything.get_message(timeout=5)["type"] == "psubscribe"
    publisher = ProgressPublisher(redis_url, None, interval=0.05)
    try:
        for job in (unfollowed, followed):
            publisher.status(job, JobStatus.running)
            publisher.status(job, JobStatus.succeeded)
        seen = []
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            if message := everything.get_message(timeout=1):
                seen.append((message["channel"].decode(), json.loads(message["data"])["status"]))
        time.sleep(0.3)  # a flush or two more: nothing else comes
        assert everything.get_message(timeout=0.1) is None
    finally:
        publisher.close()
        listener.close()
        everything.close()
    assert seen == [(progress_channel(followed), "running"), (progress_channel(followed), "succeeded")]
