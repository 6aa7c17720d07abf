"""What a job's failure shows: its tenant a stable message and its code, wherever the job is read (the job,
a chat's error body and stream, a batch's error lines); admin keys also what raised. What names a host or a
process inside the fleet is for admin keys only; a database error's text holds no parameters."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import insert

from api.app import create_app
from api.service import batch_output
from engine.interface import Completion, Timings
from jobs.error_codes import ERROR_MESSAGES, ErrorCode
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Batch, Job, job_row, utcnow
from tests.api_keys import ADMIN_KEY, auth
from worker import results, runs
from worker.claims import claim
from worker.outcome import Ending, Outcome, RunEnd
from worker.progress import ProgressPublisher

SHOP_KEY = "shop-key-0123456789"
HOST = "gpu-7.internal:4242:1700000000"  # a worker's name: its host, its process
WHAT = "CUDA error on gpu-7.internal, SELECT payload FROM jobs WHERE id = 'x'"  # what a run raised
RAISED = f"RuntimeError: {WHAT}"
STABLE = ERROR_MESSAGES[ErrorCode.engine_error]
CHAT = {"model": None, "messages": [{"role": "user", "content": "Where is my parcel?"}]}


@pytest.fixture
def settings(database, broker, tiny_model) -> Settings:
    return Settings(database_url=database, broker_url=broker, model=str(tiny_model), max_attempts=1,
                    api_keys=f"{SHOP_KEY}@shop,{ADMIN_KEY}:admin")


@pytest.fixture
def sessions(db):
    return db[1]


@pytest.fixture
def worker(settings, sessions, broker):
    """What a worker's run needs to settle a job that raised, its progress events published for real."""
    progress = ProgressPublisher(broker, tokenizer=None, interval=0.02)
    yield SimpleNamespace(settings=settings, sessions=sessions, progress=progress,
                          metrics=SimpleNamespace(gave_up=lambda: None, refused=lambda: None))
    progress.close()


def raising(exc: Exception):
    def step() -> None:
        raise exc
    return step


def run_raising(worker, job_id: str, exc: Exception) -> None:
    """Claim the job as worker `HOST` does, and run it into `exc` (its last attempt: it fails)."""
    claimed = claim(worker.sessions, job_id, HOST, worker.settings.max_attempts)
    assert runs.guarded(worker, claimed, raising(exc)) == RunEnd(Ending.SETTLED)


def test_a_run_that_raises_shows_its_tenant_a_stable_message_and_code_and_an_admin_what_raised(
        settings, worker, caplog):
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json={"messages": CHAT["messages"]}, headers=auth(SHOP_KEY)).json()["id"]
        with caplog.at_level(logging.ERROR, logger="worker.settling"):
            run_raising(worker, job_id, RuntimeError(WHAT))
        tenant = client.get(f"/v1/jobs/{job_id}", headers=auth(SHOP_KEY))
        admin = client.get(f"/v1/jobs/{job_id}", headers=auth(ADMIN_KEY)).json()
    seen = tenant.json()
    assert (seen["status"], seen["error"], seen["error_code"], seen["error_detail"]) == \
        ("failed", STABLE, "engine_error", None)
    assert "gpu-7" not in tenant.text and "SELECT" not in tenant.text
    assert (admin["error"], admin["error_code"]) == (STABLE, "engine_error")
    assert admin["error_detail"] == f"failed after 1 attempts: {RAISED}" and admin["worker"] == HOST
    assert WHAT in caplog.text  # and in the worker's log


def wait_queued(sessions, seen: set[uuid.UUID], timeout: float = 30.0) -> str:
    """The id of the next job the API stores (a chat waits on it)."""
    deadline = time.monotonic() + timeout
    while True:
        with sessions() as session:
            ids = set(session.scalars(sa.select(Job.id))) - seen
        if ids:
            [job_id] = ids
            seen.add(job_id)
            return str(job_id)
        assert time.monotonic() < deadline, "the chat's job never came"
        time.sleep(0.02)


def test_a_chat_whose_job_raised_answers_openais_error_with_its_code(settings, sessions, worker):
    chat = {**CHAT, "model": settings.model}
    answers: dict[str, object] = {}
    with TestClient(create_app(settings)) as client:
        def ask(name: str, body: dict) -> None:
            answers[name] = client.post("/v1/chat/completions", json=body, headers=auth(SHOP_KEY))

        seen: set[uuid.UUID] = set()
        for name, body in (("plain", chat), ("stream", {**chat, "stream": True})):
            asking = threading.Thread(target=ask, args=(name, body))
            asking.start()
            job_id = wait_queued(sessions, seen)
            time.sleep(0.3)  # the chat follows its job before the job ends (it would read the row otherwise)
            run_raising(worker, job_id, RuntimeError(WHAT))
            asking.join(60)
    plain, stream = answers["plain"], answers["stream"]
    expected = {"message": f"the job failed: {STABLE}", "type": "server_error", "param": None,
                "code": "engine_error"}
    assert plain.status_code == 500 and plain.json()["error"] == expected
    events = [json.loads(line.removeprefix("data: ")) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1] == {"error": expected}
    assert "gpu-7" not in plain.text + stream.text and "SELECT" not in plain.text + stream.text


def test_a_batch_error_line_of_a_job_that_raised_has_its_code_and_stable_message(settings, sessions, worker):
    with sessions.begin() as session:
        batch = Batch(status="in_progress", priority=1, total=1, tenant="shop")
        session.add(batch)
    row = job_row(JobIn(messages=CHAT["messages"], priority=1), utcnow(), tenant="shop")
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), [{**row, "batch_id": batch.id, "custom_id": "line-1"}])
    run_raising(worker, str(row["id"]), RuntimeError(WHAT))
    [line] = [json.loads(x) for x in batch_output.lines(sessions, batch.id, True, settings.model)]
    assert line["custom_id"] == "line-1" and line["error"] == {"code": "engine_error", "message": STABLE}


def test_a_job_settled_before_error_codes_shows_its_tenant_no_exception_text(settings, sessions):
    """Its error may be an exception's text: its tenant sees the code its status implies and that code's message,
    or its request's problem; admin keys see the text as its detail."""
    leaked = "OperationalError: (psycopg.OperationalError) [SQL: UPDATE jobs SET error=%(e)s] [parameters: secret]"
    rows = [job_row(JobIn(messages=CHAT["messages"]), utcnow(), tenant="shop") for _ in range(2)]
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), [{**rows[0], "status": "failed", "error": leaked},
                                                {**rows[1], "status": "failed", "error": "invalid request: grammar: x"}])
    with TestClient(create_app(settings)) as client:
        shown = [client.get(f"/v1/jobs/{r['id']}", headers=auth(SHOP_KEY)).json() for r in rows]
        admin = client.get(f"/v1/jobs/{rows[0]['id']}", headers=auth(ADMIN_KEY)).json()
    assert [(s["error"], s["error_code"], s["error_detail"]) for s in shown] == \
        [(STABLE, "engine_error", None), ("grammar: x", "invalid_prompt", None)]
    assert admin["error_detail"] == leaked


def test_a_tenant_sees_no_engine_step_an_admin_does(settings, sessions):
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json={"messages": CHAT["messages"]}, headers=auth(SHOP_KEY)).json()["id"]
        claimed = claim(sessions, job_id, HOST, 3)
        timings = Timings(queue_wait_ms=5, ttft_ms=9, prefill_ms=3, decode_ms=4, batch_size=2, first_step=11)
        done = Outcome(Completion(job_id, [1, 2], "It is on its way.", 8, "stop", timings=timings), engine_ms=8)
        assert results.store(sessions, claimed, done, HOST).applied
        tenant = client.get(f"/v1/jobs/{job_id}", headers=auth(SHOP_KEY))
        admin = client.get(f"/v1/jobs/{job_id}", headers=auth(ADMIN_KEY)).json()
    seen = tenant.json()
    assert seen["status"] == "succeeded" and seen["timings"]["batch_size"] == 2
    assert seen["timings"]["engine_step"] is None and seen["worker"] is None and "gpu-7" not in tenant.text
    assert admin["timings"]["engine_step"] == f"{HOST}:11" and admin["worker"] == HOST


def test_a_database_errors_text_holds_no_parameters(settings, sessions, worker, caplog):
    """A run the database failed: what is logged and kept as the job's detail names the statement, not the
    values it carried (a tenant's prompt, here)."""
    secret = "my card number is 4111 1111 1111 1111"
    job = job_row(JobIn(messages=CHAT["messages"]), utcnow(), tenant="shop")
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), [job])
    duplicate = job_row(JobIn(messages=[{"role": "user", "content": secret}]), utcnow(), tenant="shop")

    def write_twice() -> None:
        with sessions.begin() as session:
            session.execute(insert(Job.__table__), [{**duplicate, "id": job["id"]}])

    claimed = claim(sessions, str(job["id"]), HOST, 1)
    with caplog.at_level(logging.ERROR, logger="worker.settling"):
        assert runs.guarded(worker, claimed, write_twice) == RunEnd(Ending.SETTLED)
    with sessions() as session:
        detail = session.get(Job, job["id"]).error_detail
    assert "IntegrityError" in detail and "INSERT INTO jobs" in detail and "IntegrityError" in caplog.text
    assert secret not in detail and secret not in caplog.text
