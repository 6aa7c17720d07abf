"""A batch's ingest against real PostgreSQL and Redis: resumed by another API process when its own dies (nothing
lost, nothing twice), cancellable while it validates, its upload stored and read a chunk at a time, and a bad line
one line error whatever it holds (deep JSON, NUL, a line too long, a chat its template refuses)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState

from api.app import create_app
from api.service import batches
from api.service.batch_ingest import claim_lapsed, ingest
from api.service.batch_input import split_lines
from api.service.uploads import BatchInput
from bench.audit import messages_by_job
from cli.stack import Stack
from jobs.settings import Settings, parse_key
from tests.api_keys import ADMIN_KEY, API_KEY, AUTH, OTHER_KEY, auth
from tests.batch_waits import ingested
from tests.service_settings import settings_for
from tests.sql import sql

MIB = 2**20


def line(i: int, **extra) -> bytes:
    return json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"Where is parcel {i}?"}],
                       "max_new_tokens": 4, **extra}).encode()


def jsonl(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def upload(client: TestClient, data: bytes, **form: str) -> httpx.Response:
    return client.post("/v1/batches", files={"file": ("b.jsonl", data)}, data=form, headers=AUTH)


# --- nothing lost, nothing twice ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_ingest_cut_off_by_a_killed_api_is_finished_by_the_next(service_env, database, tmp_path):
    env = {**service_env, "CONVOQ_DEAD_AFTER_S": "2", "CONVOQ_HEARTBEAT_S": "0.5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        answer = httpx.post(f"{stack.api_url}/v1/batches", headers=AUTH, timeout=60,
                            files={"file": ("big.jsonl", jsonl([line(i) for i in range(5000)]))})
        os.killpg(stack.api.pid, signal.SIGKILL)  # right after its 202: the ingest was under way
        stack.api.wait()
        assert answer.status_code == 202, answer.text
        assert sql(database, "SELECT status FROM batches") == [("validating",)]
        stack.start_api()
        deadline = time.monotonic() + 60
        while (status := sql(database, "SELECT status FROM batches")[0][0]) == "validating":
            assert time.monotonic() < deadline, "the batch stayed validating after the restart"
            time.sleep(0.2)
    assert status == "in_progress"
    assert sql(database, "SELECT count(*) FROM jobs") == [(5000,)]
    assert_one_message_each(service_env["CONVOQ_BROKER_URL"], 5000)  # no worker runs: every message still waits
    assert sql(database, "SELECT count(*) FROM files") == [(0,)]  # the upload went once its lines were jobs


def cpu_s(pid: int) -> float:
    """The CPU time a process spent itself (its children's not counted), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_an_api_process_ingests_in_a_child_of_its_own(service_env, database, tmp_path):
    """The lines' work is done outside the API process, which keeps its interpreter's lock for its requests."""
    with Stack(service_env, tmp_path / "logs") as stack:
        stack.start_api()
        post = dict(headers=AUTH, timeout=120)
        httpx.post(f"{stack.api_url}/v1/batches", files={"file": ("warm.jsonl", jsonl([line(0)]))}, **post)
        answer = httpx.post(f"{stack.api_url}/v1/batches", **post,
                            files={"file": ("big.jsonl", jsonl([line(i) for i in range(1, 10_001)]))})
        assert answer.status_code == 202, answer.text
        before = cpu_s(stack.api.pid)
        deadline = time.monotonic() + 120
        while sql(database, "SELECT count(*) FROM batches WHERE status = 'validating'") != [(0,)]:
            assert time.monotonic() < deadline, "the batches stayed validating"
            time.sleep(0.2)
        used = cpu_s(stack.api.pid) - before
    assert sql(database, "SELECT count(*) FROM jobs") == [(10_001,)]
    # on its threads the API spent 1.5-4 s of its own CPU on these lines
    assert used < 0.5, f"the API process spent {used:.2f} s of CPU while its batch was ingested"


def assert_one_message_each(broker_url: str, jobs: int) -> None:
    client = redis.Redis.from_url(broker_url)
    found = messages_by_job(client, Settings(broker_url=broker_url))
    client.close()
    assert len(found) == jobs and all(len(messages) == 1 for messages in found.values())


def stored_batch(app, settings: Settings, data: bytes | None, file_id: str | None = None) -> tuple[uuid.UUID, uuid.UUID]:
    """A batch stored as `POST /v1/batches` stores it (from `data`, or the uploaded file `file_id`), its ingest
    not started: (batch id, its lease)."""
    given = BatchInput(upload=None if data is None else io.BytesIO(data), input_file_id=file_id, name="b.jsonl",
                       priority=None, metadata={}, completion_window="24h")
    batch, lease = batches.create(app.state.sessions, settings, app.state.intake.admission, parse_key(API_KEY),
                                  given, 1)
    return batch.id, lease


def test_an_ingest_that_lost_its_lease_changes_nothing_and_the_next_runs_each_line_once(database, broker,
                                                                                        tiny_model):
    settings = settings_for(database, broker, tiny_model)
    app = create_app(settings)  # not started: nothing resumes on its own
    batch_id, first = stored_batch(app, settings, jsonl([line(i) for i in range(30)]))
    sql(database, "UPDATE batches SET ingest_lease_expires_at = now() - interval '1 second'")
    with app.state.sessions() as session:
        [(claimed, second)] = claim_lapsed(session, 5, 30.0)
    assert claimed == batch_id and second != first
    run = (app.state.sessions, app.state.celery, settings, app.state.prompt_check, batch_id)
    ingest(*run, first)  # the first holder, woken up after losing its lease
    assert sql(database, "SELECT status, (SELECT count(*) FROM jobs) FROM batches") == [("validating", 0)]
    ingest(*run, second)
    ingest(*run, second)  # once done, again is nothing
    assert sql(database, "SELECT status, total, source_file_id FROM batches") == [("in_progress", 30, None)]
    assert sql(database, "SELECT count(*) FROM jobs") == [(30,)]
    assert_one_message_each(broker, 30)  # (batch, custom_id) is unique: what a second ingest would double is messages


def test_a_batch_cancelled_while_validating_runs_nothing_and_its_upload_goes(database, broker, tiny_model):
    settings = settings_for(database, broker, tiny_model, heartbeat_s=0.2, dead_after_s=1)
    app = create_app(settings)
    batch_id, _ = stored_batch(app, settings, jsonl([line(i) for i in range(3)]))  # its API "died" at once
    with TestClient(app) as client:
        cancelled = client.post(f"/v1/batches/{batch_id}/cancel", headers=AUTH)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        deadline = time.monotonic() + 30  # the lease lapses, the resumer takes the batch and lets its lines go
        while sql(database, "SELECT source_file_id FROM batches") != [(None,)]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert sql(database, "SELECT status FROM batches") == [("cancelled",)]
    assert sql(database, "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM files)") == [(0, 0)]


# --- memory bounded by a chunk --------------------------------------------------------------------------------------

def test_files_are_stored_and_sent_a_chunk_at_a_time(database, broker, tiny_model):
    data = jsonl([line(i, pad="x" * 1000) for i in range(2500)])  # ~2.6 MiB
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        file = client.post("/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": "batch"}, headers=AUTH)
        file_id = file.json()["id"]
        chunks = sql(database, "SELECT length(data) FROM file_chunks WHERE file_id = :f ORDER BY seq", f=file_id)
        assert [n for (n,) in chunks] == [MIB, MIB, len(data) - 2 * MIB]
        got = client.get(f"/v1/files/{file_id}/content", headers=AUTH)
        assert got.content == data and got.headers["content-length"] == str(len(data))
        # a batch still reading it keeps it (its ingest held back until the delete was refused)
        batch_id, lease = stored_batch(client.app, client.app.state.settings, None, file_id)
        assert client.delete(f"/v1/files/{file_id}", headers=AUTH).status_code == 409
        client.app.state.intake.ingest(batch_id, lease)
        assert ingested(client, str(batch_id))["request_counts"]["total"] == 2500


def test_a_line_is_split_from_its_pieces_and_one_too_long_is_never_held():
    pieces = [b'{"a": 1}\n{"b"', b": 2}\n" + b"x" * MIB, b"x" * MIB, b"x" * MIB + b"\n{}"]
    assert list(split_lines(pieces, max_line_bytes=MIB)) == [b'{"a": 1}', b'{"b": 2}', None, b"{}"]


# --- a bad line is one line error ---------------------------------------------------------------------------------

def test_a_bad_line_is_one_line_error_whatever_it_holds(database, broker, tiny_model):
    bad = [b"[" * 100_000,  # nested past any parser's recursion
           json.dumps({"custom_id": "nul\x00", "messages": [{"role": "user", "content": "hi"}]}).encode(),
           line(21, messages=[{"role": "user", "content": "NUL \x00 inside"}]),
           json.dumps({"custom_id": "x" * 300, "messages": [{"role": "user", "content": "hi"}]}).encode(),
           line(22, pad="x" * 8 * MIB)]  # longer than a request may be
    data = jsonl([line(i) for i in range(20)] + bad)
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        batch = ingested(client, upload(client, data).json()["id"])
        errors = client.get(f"/v1/batches/{batch['id']}/line_errors", headers=AUTH).json()["data"]
    assert batch["status"] == "in_progress", batch
    counts = batch["request_counts"]
    assert (counts["total"], counts["invalid"], counts["pending"]) == (25, 5, 20)
    assert [e["line"] for e in errors] == [21, 22, 23, 24, 25] and errors[0]["custom_id"] is None
    assert "nested deeper" in errors[0]["message"] and "NUL" in errors[1]["message"]
    assert "content: must not contain NUL (\\u0000) characters" in errors[2]["message"]
    assert "custom_id" in errors[3]["message"]
    assert f"longer than {8 * MIB} bytes" in errors[4]["message"]


def test_metadata_is_bounded_and_no_stored_row_fails_a_listing(database, broker, tiny_model):
    deep = json.loads("[" * 300 + "]" * 300)
    sql(database, "INSERT INTO batches (id, status, priority, total, metadata, tenant, created_at, expires_at) "
                  "VALUES (:i, 'completed', 1, 0, :m, :t, now(), now())",
        i=uuid.uuid4(), m=json.dumps({"old": deep, "kept": "yes"}), t=parse_key(API_KEY).tenant)
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        too_deep = upload(client, jsonl([line(0)]), metadata=json.dumps({"a": deep}))
        assert too_deep.status_code == 422 and "nested deeper" in too_deep.text
        many = {f"k{i}": "v" for i in range(17)}
        assert upload(client, jsonl([line(0)]), metadata=json.dumps(many)).status_code == 422
        assert upload(client, jsonl([line(0)]), metadata=json.dumps({"k": "v" * 513})).status_code == 422
        file_id = client.post("/v1/files", files={"file": ("f.jsonl", jsonl([line(0)]))}, data={"purpose": "batch"},
                              headers=AUTH).json()["id"]
        as_json = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                   "metadata": many}, headers=AUTH)
        assert as_json.status_code == 422
        for key in (API_KEY, ADMIN_KEY):
            listed = client.get("/v1/batches", headers=auth(key))
            assert listed.status_code == 200 and [b["metadata"] for b in listed.json()["data"]] == [{"kept": "yes"}]


def test_nul_is_refused_or_dropped_wherever_postgresql_would_get_it(database, broker, tiny_model):
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        made = client.post("/v1/batches", json={"input_file_id": "file-\x00", "endpoint": "/v1/chat/completions"},
                           headers=AUTH)
        assert made.status_code == 422
        assert upload(client, jsonl([line(0)]), metadata='{"k": "v\\u0000"}').status_code == 422
        job = {"messages": [{"role": "user", "content": "a\x00b"}]}
        refused = client.post("/v1/jobs", json=job, headers=AUTH)
        assert refused.status_code == 422 and refused.json()["detail"][0]["msg"] == (
            "must not contain NUL (\\u0000) characters")
        assert client.get("/v1/files/file-%00/content", headers=AUTH).status_code == 404
        assert client.get("/v1/files", params={"after": "file-\x00"}, headers=AUTH).status_code == 404
        assert client.get("/v1/files", params={"purpose": "\x00"}, headers=AUTH).json()["data"] == []
        for name, stored in ((b"a\x00b.jsonl", "ab.jsonl"), (b"n" * 300, "n" * 255)):  # sent raw, as any client may
            form = (b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--x\r\n'
                    b'Content-Disposition: form-data; name="file"; filename="' + name + b'"\r\n\r\n{}\r\n--x--\r\n')
            named = client.post("/v1/files", content=form,
                                headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"})
            assert named.status_code == 200 and named.json()["filename"] == stored


def test_a_deeply_nested_body_is_a_422_naming_it(database, broker, tiny_model):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 900 + b"]" * 900 + b"}"
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        for path in ("/v1/jobs", "/v1/chat/completions"):
            r = client.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code == 422 and "nested deeper than 64" in r.text, (path, r.text)


# --- smaller -------------------------------------------------------------------------------------------------------

def test_retry_gives_failed_items_a_fresh_run(database, broker, tiny_model):
    from worker.claims import claim_many

    app = create_app(settings_for(database, broker, tiny_model))
    with TestClient(app) as client:
        batch = ingested(client, upload(client, jsonl([line(i) for i in range(2)])).json()["id"])
        # an item that used up its attempts and crashes, as its last run left it
        sql(database, "UPDATE jobs SET status = 'failed', error = 'boom', attempts = 3, crashes = 5, "
                      "alone_at = now(), lease_id = :l WHERE custom_id = 'c1'", l=uuid.uuid4())
        assert client.post(f"/v1/batches/{batch['id']}/retry", headers=AUTH).status_code == 200
    [(job_id,)] = sql(database, "SELECT id FROM jobs WHERE custom_id = 'c1'")
    [claimed] = claim_many(app.state.sessions, [str(job_id)], "a-worker", max_attempts=3)
    assert claimed is not None and (claimed.attempt, claimed.crashes) == (1, 0)  # it runs, neither failed nor alone


def test_a_retry_counts_against_the_bounds_and_changes_nothing_when_refused(database, broker, tiny_model):
    settings = settings_for(database, broker, tiny_model, max_queued_per_key=2)
    with TestClient(create_app(settings)) as client:
        batch = ingested(client, upload(client, jsonl([line(i) for i in range(2)])).json()["id"])
        sql(database, "UPDATE jobs SET status = 'failed', error = 'boom'")
        time.sleep(1.2)  # past the admission's cached count, which still holds the two lines
        assert client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}]},
                           headers=AUTH).status_code == 202
        refused = client.post(f"/v1/batches/{batch['id']}/retry", headers=AUTH)  # 1 unfinished + 2 > 2
    assert refused.status_code == 429 and "would pass the bound" in refused.text
    assert sql(database, "SELECT status, error FROM jobs WHERE batch_id IS NOT NULL") == [("failed", "boom")] * 2


def test_a_retry_never_resets_a_job_taken_since_it_read_it(database, broker, tiny_model):
    app = create_app(settings_for(database, broker, tiny_model))
    taken = uuid.uuid4()

    def taken_meanwhile(state: ORMExecuteState):  # another retry queued c1 and a worker took it, after this read
        if not state.is_select or "FROM jobs" not in str(state.statement) or fired:
            return None
        fired.append(True)
        result = state.invoke_statement()
        sql(database, "UPDATE jobs SET status = 'running', error = NULL, lease_id = :l, worker = 'w' "
                      "WHERE custom_id = 'c1'", l=taken)
        return result

    fired: list[bool] = []
    with TestClient(app) as client:
        batch = ingested(client, upload(client, jsonl([line(i) for i in range(2)])).json()["id"])
        sql(database, "UPDATE jobs SET status = 'failed', error = 'boom'")
        event.listen(app.state.sessions, "do_orm_execute", taken_meanwhile)
        retried = client.post(f"/v1/batches/{batch['id']}/retry", headers=AUTH)
        event.remove(app.state.sessions, "do_orm_execute", taken_meanwhile)
    assert fired and retried.status_code == 200
    assert sql(database, "SELECT custom_id, status, lease_id, worker FROM jobs ORDER BY custom_id") == [
        ("c0", "queued", None, None), ("c1", "running", taken, "w")]


def test_an_ingest_whose_statement_fails_ends_its_batch_failed_with_the_reason(database, broker, tiny_model,
                                                                              monkeypatch):
    from api.service import batch_ingest

    def timed_out(session, *_args, **_kwargs) -> None:  # the insert of the lines runs past a statement timeout
        session.execute(sa.text("SET LOCAL statement_timeout = 1"))
        session.execute(sa.text("SELECT pg_sleep(1)"))

    monkeypatch.setattr(batch_ingest, "copy_ignore", timed_out)
    settings = settings_for(database, broker, tiny_model, heartbeat_s=0.2, dead_after_s=1)
    with TestClient(create_app(settings)) as client:
        batch_id = upload(client, jsonl([line(i) for i in range(3)])).json()["id"]
        deadline = time.monotonic() + 20  # three tries, a lease apart
        while (batch := client.get(f"/v1/batches/{batch_id}", headers=AUTH).json())["status"] == "validating":
            assert time.monotonic() < deadline, "an ingest failing on the database is tried forever"
            time.sleep(0.1)
        [error] = client.get(f"/v1/batches/{batch_id}/line_errors", headers=AUTH).json()["data"]
    assert batch["status"] == "failed"
    assert error["line"] == 0 and "ingest failed 3 times" in error["message"]
    assert "statement timeout" in error["message"] and "pg_sleep" not in error["message"]
    assert sql(database, "SELECT ingest_failures, source_file_id FROM batches") == [(3, None)]


def test_a_cursor_of_another_tenant_answers_as_an_unknown_one(database, broker, tiny_model):
    other = auth(OTHER_KEY)
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        theirs = upload(client, jsonl([line(0)])).json()["id"]
        their_file = client.post("/v1/files", files={"file": ("f.jsonl", b"{}\n")}, data={"purpose": "batch"},
                                 headers=AUTH).json()["id"]
        for path, cursor, unknown in [("/v1/batches", theirs, str(uuid.uuid4())),
                                      ("/v1/files", their_file, f"file-{uuid.uuid4().hex}")]:
            seen = client.get(path, params={"after": cursor}, headers=other)
            never = client.get(path, params={"after": unknown}, headers=other)
            assert seen.status_code == never.status_code == 404
            assert seen.json()["detail"].replace(cursor, "ID") == never.json()["detail"].replace(unknown, "ID")


@pytest.fixture
def strict_template_model(tiny_model, tmp_path) -> Path:
    """The tiny model with a chat template that raises, as newer Qwen templates do, when a system message is not
    the first."""
    folder = tmp_path / "strict"
    shutil.copytree(tiny_model, folder)
    template = folder / "chat_template.jinja"
    template.write_text("{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
                        "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
                        + template.read_text())
    return folder


def test_a_chat_its_template_refuses_is_a_4xx_and_one_line_error(database, broker, strict_template_model):
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"},
                   {"role": "user", "content": "where is my parcel?"}]
    settings = settings_for(database, broker, strict_template_model)
    with TestClient(create_app(settings)) as client:
        job = client.post("/v1/jobs", json={"messages": late_system}, headers=AUTH)
        assert job.status_code == 422 and "System message must be at the beginning" in job.text
        chat = client.post("/v1/chat/completions", json={"model": settings.model, "messages": late_system},
                           headers=AUTH)
        assert chat.status_code == 400 and "System message must be at the beginning" in chat.json()["error"]["message"]
        batch = ingested(client, upload(client, jsonl([line(0), line(1, messages=late_system)])).json()["id"])
        errors = client.get(f"/v1/batches/{batch['id']}/line_errors", headers=AUTH).json()["data"]
    assert batch["status"] == "in_progress" and batch["request_counts"]["pending"] == 1
    assert [e["line"] for e in errors] == [2] and "System message" in errors[0]["message"]


def test_a_slow_batch_insert_never_holds_up_other_requests(database, broker, tiny_model):
    answers: dict[str, int] = {}
    locker = sa.create_engine(database)
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client, locker.connect() as lock:
        lock.execute(sa.text("LOCK TABLE batches IN ACCESS EXCLUSIVE MODE"))  # the batch's insert waits on it

        def post() -> None:
            answers["batch"] = upload(client, jsonl([line(0)])).status_code

        def health() -> None:
            answers["healthz"] = client.get("/healthz").status_code

        posting = threading.Thread(target=post)
        posting.start()
        time.sleep(1.0)
        probing = threading.Thread(target=health)
        probing.start()
        probing.join(10)
        answered = "healthz" in answers
        lock.rollback()
        posting.join(30)
        probing.join(30)
    locker.dispose()
    assert answered, "a batch waiting on the database froze the event loop"
    assert answers == {"batch": 202, "healthz": 200}


def test_a_multipart_null_priority_is_no_priority(database, broker, tiny_model):
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        made = upload(client, jsonl([line(0)]), priority="null")
        assert made.status_code == 202 and made.json()["priority"] == 1


def test_lines_whose_publish_failed_are_sent_once_each_by_the_sweep(database, broker, tiny_model, monkeypatch):
    from broker import publish as publishing
    from worker.sweep import Sweeper

    settings = settings_for(database, broker, tiny_model, unpublished_grace_s=0, bulk_group=8)
    app = create_app(settings)  # not started: nothing resumes on its own
    batch_id, lease = stored_batch(app, settings, jsonl([line(i) for i in range(20)]))

    def refused(*_args, **_kwargs) -> None:
        raise ConnectionError("the broker refused")

    monkeypatch.setattr(publishing, "_send", refused)
    ingest(app.state.sessions, app.state.celery, settings, app.state.prompt_check, batch_id, lease)
    monkeypatch.undo()
    # stored stamped (one write a line), the stamps of the refused ones taken back: to the sweep, jobs never sent
    assert sql(database, "SELECT count(*) FROM jobs WHERE published_at IS NULL") == [(20,)]
    client = redis.Redis.from_url(broker)
    assert messages_by_job(client, settings) == {}
    sweeper = Sweeper(app.state.sessions, app.state.celery, settings)
    assert sweeper.sweep(force=True)["published"] == 20  # sent at the first sweep, not after two
    assert sweeper.sweep(force=True)["published"] == 0  # and never a second time
    found = messages_by_job(client, settings)
    client.close()
    assert len(found) == 20 and all(len(messages) == 1 for messages in found.values())
