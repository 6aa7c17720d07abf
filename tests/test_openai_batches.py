"""The official `openai` SDK as the client of our Files, Batches and Models routes, against the service as real
processes: upload, create a batch from the file, poll it, download its output and error files, list, cancel."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import httpx
import openai
import pytest
import redis

from api.app import create_app
from cli.stack import Stack
from jobs.settings import Settings
from tests.api_keys import API_KEY, AUTH, OTHER_KEY
from tests.openai_sdk import sdk

pytestmark = pytest.mark.slow

MAX_UPLOAD = 64 * 1024
SETTLED = ("completed", "failed", "cancelled", "expired")
BAD_LINE = {"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "qwen3", "messages": [{"role": "wizard", "content": "Abracadabra."}]}}


def line(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "qwen3", "max_tokens": 4,
                     "messages": [{"role": "user", "content": f"Customer {custom_id}: my invoice is wrong."}]}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(obj).encode() + b"\n" for obj in lines)


@pytest.fixture(scope="module")
def service(tiny_model, postgres_url, redis_url, tmp_path_factory):
    """API + one worker whose bulk requests take ten minutes and urgent ones a moment (`tests.slow_backend`):
    batches at priority 9 finish at once, bulk ones stay running until cancelled. One stack for the module:
    each costs ~15 s to start."""
    from migrations.apply import upgrade
    from tests.conftest import _new_database

    database = _new_database(postgres_url)
    upgrade(database)
    redis.Redis.from_url(redis_url).flushdb()
    env = {"CONVOQ_DATABASE_URL": database, "CONVOQ_BROKER_URL": redis_url, "CONVOQ_MODEL": str(tiny_model),
           "CONVOQ_API_KEYS": f"{API_KEY},{OTHER_KEY}", "CONVOQ_BACKEND": "tests.slow_backend:create",
           "CONVOQ_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    with Stack(env, tmp_path_factory.mktemp("logs")) as stack:
        stack.start_api()
        stack.start_worker()
        yield stack


@pytest.fixture
def client(service) -> openai.OpenAI:
    with sdk(service) as c:
        yield c


def settled(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in SETTLED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def upload(client: openai.OpenAI, lines: list[dict], name: str = "calls.jsonl"):
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def test_upload_run_and_download_every_line_once(client, service):
    lines = [line(f"req-{i}") for i in range(6)]
    lines.insert(3, BAD_LINE)
    data = jsonl(lines)
    file = client.files.create(file=("calls.jsonl", data), purpose="batch")
    assert file.id.startswith("file-") and file.object == "file" and file.status == "processed"
    assert (file.bytes, file.filename, file.purpose) == (len(data), "calls.jsonl", "batch")
    assert client.files.retrieve(file.id).id == file.id
    assert client.files.content(file.id).content == data

    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"priority": "9", "project": "invoices"})
    assert batch.status == "validating" and batch.input_file_id == file.id
    assert batch.metadata == {"priority": "9", "project": "invoices"} and batch.priority == 9
    assert batch.output_file_id is None and batch.error_file_id is None
    batch = settled(client, batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 6, 1)
    assert counts.invalid == 1  # the batch object counts its bad lines; they are listed a page at a time
    listed = httpx.get(f"{service.api_url}/v1/batches/{batch.id}/line_errors",
                       headers=AUTH).json()
    [error] = listed["data"]
    assert (error["code"], error["line"], error["custom_id"]) == ("invalid_line", 4, "bad-1")
    assert "role" in error["message"] and listed["has_more"] is False

    output = client.files.content(batch.output_file_id)
    errors = client.files.content(batch.error_file_id)
    output_lines = [json.loads(x) for x in output.text.splitlines()]
    error_lines = [json.loads(x) for x in errors.text.splitlines()]
    seen = Counter(x["custom_id"] for x in output_lines + error_lines)
    assert seen == Counter(x["custom_id"] for x in lines)  # every line exactly once
    assert [x["custom_id"] for x in error_lines] == ["bad-1"] and error_lines[0]["error"]["code"] == "invalid_line"
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["object"] == "chat.completion"
               for x in output_lines)

    described = client.files.retrieve(batch.output_file_id)
    assert (described.purpose, described.bytes) == ("batch_output", len(output.content))
    with pytest.raises(openai.BadRequestError, match="nothing to delete"):
        client.files.delete(batch.error_file_id)
    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(batch.id)
    with pytest.raises(openai.BadRequestError, match="batch_output"):  # results are no input
        client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")


def test_cancel_a_running_bulk_batch(client):
    file = upload(client, [line(f"bulk-{i}") for i in range(5)])
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.priority == 1  # bulk work defaults low: the slow backend keeps it running
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert batch.status == "in_progress" and batch.request_counts.pending == 5
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = settled(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.cancelled == 5
    assert batch.output_file_id is None and batch.error_file_id is not None
    error_lines = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in error_lines) == [f"bulk-{i}" for i in range(5)]
    assert {x["error"]["code"] for x in error_lines} == {"cancelled"}


def test_list_batches_newest_first_in_pages(client):
    file = upload(client, [line("one")])
    made = [client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  extra_headers={"X-Convoq-Priority": "9"}).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    assert client.batches.list(limit=2, after=first.data[-1].id).data[0].id == made[0]
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the pages to the end
    assert [i for i in listed if i in made] == made[::-1] and len(listed) == len(set(listed))
    assert all(settled(client, i).status == "completed" for i in made)  # X-Convoq-Priority: 9, not bulk


def test_files_list_delete_and_refusals(client, service):
    first, second = upload(client, [line("a")], "a.jsonl"), upload(client, [line("b")], "b.jsonl")
    assert [f.id for f in client.files.list(purpose="batch") if f.id in (first.id, second.id)] == [second.id, first.id]
    with sdk(service, OTHER_KEY) as other:
        assert first.id not in [f.id for f in other.files.list()]  # listed for the tenant that uploaded it
        with pytest.raises(openai.NotFoundError):  # another tenant: not read, used or deleted
            other.files.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            other.files.delete(first.id)
    deleted = client.files.delete(first.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (first.id, True, "file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=first.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert first.id not in [f.id for f in client.files.list()]

    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * (MAX_UPLOAD + 1)), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        client.batches.create(input_file_id=second.id, endpoint="/v1/embeddings", completion_window="24h")


def test_models_auth_and_unknown_ids(client, service):
    model = service.env["CONVOQ_MODEL"]
    assert [(m.id, m.object, m.owned_by) for m in client.models.list()] == [(model, "model", "convoq")]
    assert client.models.retrieve(model).id == model  # the SDK sends its slashes as %2F
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("Qwen/Qwen3-8B")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(str(uuid.uuid4()))
    with pytest.raises(openai.NotFoundError):
        client.files.content(f"file-{uuid.uuid4().hex}-output")
    with sdk(service, "not-a-key-of-ours") as stranger, pytest.raises(openai.AuthenticationError):
        stranger.batches.list()


def test_openapi_documents_both_batch_bodies(tiny_model, tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path}/c.db", model=str(tiny_model), api_keys=API_KEY))
    paths = app.openapi()["paths"]
    bodies = paths["/v1/batches"]["post"]["requestBody"]["content"]
    assert bodies["application/json"]["schema"]["required"] == ["input_file_id", "endpoint"]
    assert bodies["multipart/form-data"]["schema"]["properties"]["file"]["format"] == "binary"
    assert {"get", "post"} <= set(paths["/v1/files"]) and {"get", "delete"} <= set(paths["/v1/files/{file_id}"])
    assert "/v1/files/{file_id}/content" in paths and "/v1/models/{model_id}" in paths
