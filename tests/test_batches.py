"""Bulk batches on real processes: OpenAI-format uploads, per-line errors, cancel, retry, priorities, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa

from api.http.client import Client
from cli.stack import Stack
from jobs.schemas import JobIn
from jobs.status import BATCH_SETTLED
from tests.api_keys import API_KEY

pytestmark = pytest.mark.slow


def openai_line(i: int, max_tokens: int = 4) -> dict:
    return {"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "qwen3", "max_tokens": max_tokens,
                     "messages": [{"role": "system", "content": "Summarize the call."},
                                  {"role": "user", "content": f"Customer {i}: my invoice {i} is wrong."}]}}


def upload(n: int, bad: dict[int, bytes] | None = None, max_tokens: int = 4) -> bytes:
    bad = bad or {}
    return b"\n".join(bad.get(i) or json.dumps(openai_line(i, max_tokens)).encode() for i in range(n)) + b"\n"


def wait_settled(client: Client, batch_id, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.get_batch(batch_id)
        if batch.status in BATCH_SETTLED or time.monotonic() > deadline:
            return batch
        time.sleep(0.3)


@pytest.fixture
def slow_stack(service_env, tmp_path):
    """Small batches and few threads, so a batch takes long enough to act on while it runs."""
    env = {**service_env, "CONVOQ_MAX_BATCH_SIZE": "4", "CONVOQ_WORKER_CONCURRENCY": "8"}
    with Stack(env, tmp_path / "logs") as s:
        s.start_api()
        yield s


def test_two_hundred_lines_with_five_malformed(stack):
    bad = {
        17: b'{"custom_id": "req-017", "body": {',
        42: json.dumps(openai_line(42) | {"url": "/v1/completions"}).encode(),
        99: json.dumps(openai_line(99) | {"body": {"messages": [{"role": "wizard", "content": "x"}]}}).encode(),
        150: json.dumps(openai_line(150) | {"method": "DELETE"}).encode(),
        199: json.dumps(openai_line(199, max_tokens=-5)).encode(),
    }
    with Client(stack.api_url, API_KEY) as client:
        batch = client.create_batch(upload(200, bad), name="calls.jsonl")
        assert batch.status == "validating"
        batch = wait_settled(client, batch.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed, counts.pending) == (200, 195, 5, 0)
        assert [e.line for e in client.line_errors(batch.id)] == [18, 43, 100, 151, 200]
        assert batch.request_counts.invalid == 5
        output = list(client.batch_lines(batch.id))
        errors = list(client.batch_lines(batch.id, errors=True))
    assert len(output) == 195 and len(errors) == 5
    for line in output:  # the OpenAI Batch output shape
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["completion_tokens"] > 0
    for line in errors:
        assert line["response"] is None and line["error"]["message"]
    ids = [line["custom_id"] for line in output + errors if line["custom_id"]]
    assert len(ids) == len(set(ids)) == 199  # the line with broken JSON has no readable custom_id
    assert set(ids) == {f"req-{i:03d}" for i in range(200)} - {"req-017"}


def test_cancel_mid_run_keeps_finished_results(slow_stack):
    with Client(slow_stack.api_url, API_KEY) as client:
        batch = client.create_batch(upload(80, max_tokens=16))
        slow_stack.start_worker()
        while client.get_batch(batch.id).request_counts.completed < 4:
            time.sleep(0.2)
        cancelled = client.cancel_batch(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        batch = wait_settled(client, batch.id)
        output = list(client.batch_lines(batch.id))
        errors = list(client.batch_lines(batch.id, errors=True))
    counts = batch.request_counts
    assert batch.status == "cancelled"
    assert counts.completed >= 4 and counts.cancelled > 0 and counts.completed + counts.cancelled == 80
    assert len(output) == counts.completed and all(line["response"]["status_code"] == 200 for line in output)
    assert sum(e["error"]["code"] == "cancelled" for e in errors) == counts.cancelled


def test_interactive_jobs_overtake_a_running_batch(slow_stack, database):
    with Client(slow_stack.api_url, API_KEY) as client:
        batch = client.create_batch(upload(100, max_tokens=16))
        slow_stack.start_worker()
        while client.get_batch(batch.id).request_counts.completed < 4:
            time.sleep(0.1)
        urgent = [client.submit(JobIn(messages=[{"role": "user", "content": f"urgent {i}"}], priority=9,
                                      sampling={"max_new_tokens": 4})).id for i in range(5)]
        finished = [client.wait(i, timeout=120) for i in urgent]
        wait_settled(client, batch.id)
    assert all(j.status == "succeeded" for j in finished)
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        # the lines not yet done when the first urgent job came, and those of them done between the moment the last
        # urgent job reached the worker and the moment it was done
        lines = "SELECT count(*) FROM jobs WHERE batch_id IS NOT NULL AND finished_at > :after"
        waiting = conn.execute(sa.text(lines), {"after": min(j.created_at for j in finished)}).scalar()
        overtook = conn.execute(sa.text(lines + " AND finished_at < :before"), {
            "after": max(j.started_at for j in finished), "before": max(j.finished_at for j in finished)}).scalar()
    engine.dispose()
    # the batch was far from done (how far depends on how fast this machine runs it meanwhile). Once the urgent jobs
    # are in the worker, only the lines already in the engine's batch (4 rows) may finish before them; their way
    # there (API, broker, a thread kept free of bulk) is not counted: on a loaded machine it takes seconds, and the
    # worker runs lines it holds meanwhile
    assert waiting >= 50
    assert overtook <= 4 + 4, overtook


def test_retry_reruns_failed_items_in_one_call(stack, database):
    with Client(stack.api_url, API_KEY) as client:
        batch = wait_settled(client, client.create_batch(upload(6)).id)
        assert batch.request_counts.completed == 6
        engine = sa.create_engine(database)
        with engine.begin() as conn:  # two items failed (as a crash would leave them)
            conn.execute(sa.text("DELETE FROM timings WHERE job_id IN (SELECT id FROM jobs WHERE custom_id IN ('req-001','req-004'))"))
            conn.execute(sa.text("DELETE FROM results WHERE job_id IN (SELECT id FROM jobs WHERE custom_id IN ('req-001','req-004'))"))
            conn.execute(sa.text("UPDATE jobs SET status='failed', error='engine crashed' WHERE custom_id IN ('req-001','req-004')"))
        engine.dispose()
        assert client.get_batch(batch.id).request_counts.failed == 2
        retried = client.retry_batch(batch.id)
        assert retried.status == "in_progress"
        batch = wait_settled(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 6
        assert batch.request_counts.failed == 0
        assert len(list(client.batch_lines(batch.id))) == 6


def test_cli_submit_wait_download(stack, tmp_path):
    path = tmp_path / "calls.jsonl"
    path.write_bytes(upload(12, bad={3: b"not json"}))
    env = {**stack.env, "CONVOQ_API_URL": stack.api_url, "CONVOQ_API_KEY": API_KEY}
    out = tmp_path / "out.jsonl"
    run = subprocess.run([sys.executable, "-m", "cli.main", "batch", "submit", str(path), "--wait", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1, run.stderr  # one line failed
    assert "completed 11" in run.stdout and "failed 1" in run.stdout
    assert "line 4" in run.stderr and "batch" in run.stderr  # the bad line and the progress bar
    assert len(out.read_text().splitlines()) == 11
    batch_id = run.stdout.split()[1]
    errors = tmp_path / "errors.jsonl"
    run = subprocess.run([sys.executable, "-m", "cli.main", "batch", "download", batch_id, "--out", str(tmp_path / "o2.jsonl"),
                          "--errors", str(errors)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(errors.read_text())["error"]["code"] == "invalid_line"
