"""Job control through the running service: cancel, deadlines, backpressure, live progress, Flower labels."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from itertools import pairwise

import httpx
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_app
from api.http.client import AsyncClient, Client
from broker.app import CANCEL_COMMAND, create_celery
from cli.stack import Stack
from jobs.schemas import JobIn
from jobs.settings import Settings
from tests.api_keys import API_KEY, AUTH, OTHER_KEY, auth
from tests.batch_waits import ingested
from tests.service_settings import settings_for
from tests.sql import sql
from tests.waits import until


def chat(text: str, max_new_tokens: int = 16, **extra) -> JobIn:
    return JobIn(messages=[{"role": "user", "content": text}], priority=9,
                 sampling={"max_new_tokens": max_new_tokens}, **extra)


# --- the API alone (in-process, real PostgreSQL and Redis) ------------------------------------------------------

def api(database: str, broker: str, tiny_model, **settings) -> TestClient:
    return TestClient(create_app(settings_for(database, broker, tiny_model, **settings)))


def test_cancel_a_queued_job_then_again_and_a_finished_one(database, broker, tiny_model):
    with api(database, broker, tiny_model) as client:
        job_id = client.post("/v1/jobs", json=chat("hi").model_dump(mode="json"), headers=AUTH).json()["id"]
        first = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
        assert first.status_code == 200 and first.json()["status"] == "cancelled"
        again = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)  # idempotent
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
        assert client.post(f"/v1/jobs/{uuid.uuid4()}/cancel", headers=AUTH).status_code == 404
        done = client.post("/v1/jobs", json=chat("bye").model_dump(mode="json"), headers=AUTH).json()["id"]
        sql(database, "UPDATE jobs SET status = 'succeeded' WHERE id = :i", i=uuid.UUID(done))
        refused = client.post(f"/v1/jobs/{done}/cancel", headers=AUTH)
        assert refused.status_code == 409 and "succeeded" in refused.json()["detail"]
        assert sql(database, "SELECT status FROM jobs WHERE id = :i", i=uuid.UUID(done)) == [("succeeded",)]


def test_a_running_job_is_marked_for_cancel_and_stays_running_until_its_worker_stops_it(database, broker, tiny_model):
    with api(database, broker, tiny_model) as client:
        job_id = client.post("/v1/jobs", json=chat("hi").model_dump(mode="json"), headers=AUTH).json()["id"]
        sql(database, "UPDATE jobs SET status = 'running' WHERE id = :i", i=uuid.UUID(job_id))
        job = client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH).json()
    assert job["status"] == "running" and job["cancel_requested_at"] is not None


def test_backpressure_refuses_past_the_bounds_and_stores_nothing(database, broker, tiny_model):
    lines = b"\n".join(b'{"custom_id": "c%d", "messages": [{"role": "user", "content": "hi"}]}' % i for i in range(2))
    with api(database, broker, tiny_model, max_queued_per_key=3, max_queued=4, busy_retry_after_s=7) as client:
        assert client.get("/readyz").json()["accepting"] is True
        for i in range(3):
            assert client.post("/v1/jobs", json=chat(f"q{i}").model_dump(mode="json"), headers=AUTH).status_code == 202
        over = client.post("/v1/jobs", json=chat("one too many").model_dump(mode="json"), headers=AUTH)
        assert over.status_code == 429 and over.headers["Retry-After"] == "7" and "this API key" in over.json()["detail"]
        batch = client.post("/v1/batches", files={"file": ("b.jsonl", lines)}, headers=AUTH)
        assert batch.status_code == 429  # a batch counts its lines
        other = auth(OTHER_KEY)
        assert client.post("/v1/jobs", json=chat("mine").model_dump(mode="json"), headers=other).status_code == 202
        overall = client.post("/v1/jobs", json=chat("fifth").model_dump(mode="json"), headers=other)
        assert overall.status_code == 429 and "the service" in overall.json()["detail"]
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["accepting"] is False
        assert client.get("/healthz").status_code == 200  # alive, only not taking work
    assert sql(database, "SELECT count(*) FROM jobs")[0][0] == 4
    assert sql(database, "SELECT count(*) FROM batches")[0][0] == 0


def test_a_batch_cancel_that_deadlocks_with_another_writer_is_retried_not_failed(database, broker, tiny_model):
    """Another transaction (a claim, a heartbeat) holds one of the batch's rows and then wants another that the
    cancel holds: PostgreSQL aborts one of the two. If that is the cancel, it runs again instead of answering
    500."""
    lines = b"\n".join(b'{"custom_id": "c%d", "messages": [{"role": "user", "content": "hi"}]}' % i for i in range(2))
    with api(database, broker, tiny_model) as client:
        batch_id = client.post("/v1/batches", files={"file": ("b.jsonl", lines)}, headers=AUTH).json()["id"]
        ingested(client, batch_id)  # its lines become jobs after the answer
        low, high = sorted(row[0] for row in sql(database, "SELECT id FROM jobs"))
        engine = sa.create_engine(database)
        with engine.connect() as other:
            other.execute(sa.text("UPDATE jobs SET priority = priority WHERE id = :i"), {"i": high})
            answer: list[httpx.Response] = []
            cancelling = threading.Thread(
                target=lambda: answer.append(client.post(f"/v1/batches/{batch_id}/cancel", headers=AUTH)))
            cancelling.start()
            time.sleep(0.3)  # the cancel now holds `low` and waits for `high`
            try:  # the deadlock: one of the two is aborted after PostgreSQL's deadlock_timeout (1 s)
                other.execute(sa.text("UPDATE jobs SET priority = priority WHERE id = :i"), {"i": low})
                other.commit()
            except sa.exc.OperationalError:
                other.rollback()
            cancelling.join(30)
        engine.dispose()
    [response] = answer
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "cancelled"
    assert sql(database, "SELECT status FROM jobs") == [("cancelled",), ("cancelled",)]


def test_deadline_and_window_inputs_are_checked(database, broker, tiny_model):
    with api(database, broker, tiny_model) as client:
        for bad in (0, -1, 10**9):
            r = client.post("/v1/jobs", json={**chat("hi").model_dump(mode="json"), "deadline_s": bad}, headers=AUTH)
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "deadline_s"
        r = client.post("/v1/batches", files={"file": ("b.jsonl", b"{}")}, data={"completion_window": "soon"},
                        headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "completion_window"]
        assert "not a window like '24h'" in r.json()["detail"][0]["msg"]
        ok = client.post("/v1/jobs", json={**chat("hi").model_dump(mode="json"), "deadline_s": 30}, headers=AUTH)
        job = client.get(f"/v1/jobs/{ok.json()['id']}", headers=AUTH).json()
    assert job["deadline_at"] is not None


def test_every_new_route_documents_its_errors(database, broker, tiny_model):
    with api(database, broker, tiny_model) as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert {"404", "409"} <= set(paths["/v1/jobs/{job_id}/cancel"]["post"]["responses"])
    assert {"404", "409"} <= set(paths["/v1/batches/{batch_id}/cancel"]["post"]["responses"])
    assert "text/event-stream" in paths["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert "404" in paths["/v1/jobs/{job_id}/events"]["get"]["responses"]
    assert "429" in paths["/v1/jobs"]["post"]["responses"] and "429" in paths["/v1/batches"]["post"]["responses"]
    assert "503" in paths["/readyz"]["get"]["responses"]
    for path, method in (("/v1/jobs/{job_id}/cancel", "post"), ("/v1/jobs/{job_id}/events", "get"),
                         ("/v1/batches/{batch_id}/cancel", "post")):
        assert {"401", "403", "404", "422", "429"} <= set(paths[path][method]["responses"]), path


# --- the service as real processes ------------------------------------------------------------------------------

def follow(client: Client, job_id, events: list, seen: threading.Event | None = None, tokens: int = 0) -> threading.Thread:
    """Collect the job's events on a thread; `seen` is set once a text event has at least `tokens` tokens."""

    def run() -> None:
        for event in client.stream(job_id):
            events.append(event)
            if seen is not None and event.event == "text" and event.tokens >= tokens:
                seen.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def follow_async(client_url: str, job_id, events: list) -> threading.Thread:
    """The same with the async client, as a chat UI's backend would follow a job."""

    async def collect() -> None:
        async with AsyncClient(client_url, API_KEY) as client:
            async for event in client.stream(job_id):
                events.append(event)

    thread = threading.Thread(target=asyncio.run, args=(collect(),), daemon=True)
    thread.start()
    return thread


def engine_running(metrics_url: str) -> float:
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("convoq_engine_running_requests "):
            return float(line.split()[1])
    raise AssertionError("no running-requests gauge")


def test_cancel_mid_generation_keeps_the_text_and_events_follow_it(paced):
    with Client(paced.api_url, API_KEY) as client:
        job_id = client.submit(chat("Tell me a long story about routers", max_new_tokens=900)).id
        events, late_events, seen = [], [], threading.Event()
        early = follow(client, job_id, events, seen, tokens=12)
        assert seen.wait(60), events
        late = follow_async(paced.api_url, job_id, late_events)  # connects mid-generation
        time.sleep(0.5)
        tokens_seen = max(e.tokens for e in events if e.event == "text")
        cancel = subprocess.run([sys.executable, "-m", "cli.main", "cancel", str(job_id), "--url", paced.api_url,
                                 "--api-key", API_KEY], capture_output=True, text=True, timeout=60)
        assert cancel.returncode == 0 and "cancel requested" in cancel.stdout, cancel.stderr
        # counted from the cancel's answer: the CLI's own start-up takes seconds on a loaded machine
        asked, tokens_asked = time.monotonic(), max(e.tokens for e in events if e.event == "text")
        job = client.wait(job_id, timeout=60)
        stopped_in = time.monotonic() - asked
        early.join(30)
        late.join(30)
    assert job.status == "cancelled" and job.result.finish_reason == "cancelled"
    # stopped within a few paced steps of the broadcast, far from its 900 tokens
    assert stopped_in < 5 and tokens_seen <= job.result.completion_tokens < tokens_asked + 150
    assert job.result.text
    # the engine let the request go (its gauge refreshes every `metrics_refresh_s`: it may lag a moment)
    until(lambda: engine_running(paced.metrics_url) == 0, 15)
    texts = [e.text for e in events if e.event == "text"]
    assert len(texts) >= 2 and all(b.startswith(a) and len(b) > len(a) for a, b in pairwise(texts))
    assert [e.event for e in events[-2:]] == ["status", "result"] and events[-1].job.status == "cancelled"
    assert events[0].status in ("queued", "running")
    # the late subscriber starts from the current state: running, then everything so far in its first text
    assert late_events[0].event == "status" and late_events[0].status == "running"
    first_text = next(e for e in late_events if e.event == "text")
    assert first_text.tokens >= 12 and late_events[-1].event == "result"


def test_deadlines_while_running_and_while_queued_and_cancel_before_claim(paced, database):
    with Client(paced.api_url, API_KEY) as client:
        running = client.submit(chat("A long answer please", max_new_tokens=900, deadline_s=3)).id
        job = client.wait(running, timeout=60)
        assert job.status == "expired" and job.result.finish_reason == "expired"
        assert 0 < job.result.completion_tokens < 900 and job.error
        paced.kill_worker()
        waits = client.submit(chat("too late", deadline_s=1)).id
        dropped = client.submit(chat("never mind")).id
        assert client.cancel(dropped).status == "cancelled"
        time.sleep(1.5)
        paced.start_worker()  # both messages are still in Redis
        assert client.wait(client.submit(chat("after")).id, timeout=60).status == "succeeded"
        expired, cancelled = client.get(waits), client.get(dropped)
    assert expired.status == "expired" and expired.started_at is None and expired.result is None
    assert cancelled.status == "cancelled" and cancelled.started_at is None and cancelled.attempts == 0


def test_a_batch_window_expires_running_and_queued_items(service_env, database, tmp_path):
    env = {**service_env, "CONVOQ_BACKEND": "tests.slow_backend:create", "CONVOQ_WORKER_CONCURRENCY": "2",
           "CONVOQ_HEARTBEAT_S": "0.5"}
    lines = "\n".join(f'{{"custom_id": "r{i}", "messages": [{{"role": "user", "content": "hi {i}"}}]}}' for i in range(5))
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, API_KEY) as client:
            batch = client.create_batch(lines.encode(), completion_window="4s")
            assert batch.completion_window == "4s" and batch.expires_at - batch.created_at == 4
            deadline = time.monotonic() + 60
            while (batch := client.get_batch(batch.id)).status != "expired" and time.monotonic() < deadline:
                time.sleep(0.3)
            errors = list(client.batch_lines(batch.id, errors=True))
    assert batch.status == "expired" and batch.expired_at is not None
    assert batch.request_counts.expired == 5 and batch.request_counts.pending == 0
    assert sorted(e["custom_id"] for e in errors) == [f"r{i}" for i in range(5)]
    assert all(e["error"]["code"] == "expired" for e in errors)
    # the worker held some of them when the window closed: they were stopped, not left to run for ten minutes
    started = sql(database, "SELECT count(*) FROM jobs WHERE started_at IS NOT NULL")[0][0]
    assert started >= 1
    # those were stopped in the engine (a result with the reason), not merely marked in the database
    stopped = sql(database, "SELECT count(*) FROM jobs JOIN results ON results.job_id = jobs.id "
                            "WHERE jobs.started_at IS NOT NULL AND results.finish_reason = 'expired'")[0][0]
    assert stopped == started


def test_submit_stream_prints_the_text_as_it_comes(paced):
    out = subprocess.run([sys.executable, "-m", "cli.main", "submit", "Hello there", "--stream", "--max-new-tokens",
                          "40", "--url", paced.api_url, "--api-key", API_KEY], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    job_id, outcome = out.stderr.strip().splitlines()[-1].strip("[]").split(" ", 1)
    assert outcome == "succeeded: length" and out.stdout.strip()
    with Client(paced.api_url, API_KEY) as client:
        assert client.get(job_id).result.text.strip() == out.stdout.strip()


def test_the_cancel_broadcast_reaches_the_worker_running_the_job(paced):
    """The worker answers the broadcast with the job it stopped (the API sends it without waiting for replies)."""
    with Client(paced.api_url, API_KEY) as client:
        job_id = str(client.submit(chat("Go on and on", max_new_tokens=900)).id)
        deadline = time.monotonic() + 60
        while client.get(job_id).status != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        celery = create_celery(Settings(broker_url=paced.env["CONVOQ_BROKER_URL"]))
        replies = celery.control.broadcast(CANCEL_COMMAND, arguments={"job_ids": [job_id, "not-here"]},
                                           reply=True, timeout=5)
        assert [r["stopped"] for reply in replies for r in reply.values()] == [[job_id]], replies
        assert client.wait(job_id, timeout=30).status == "cancelled"
