"""Results with long log-probabilities (`n` > 1, `top_logprobs`): a batch's output read in pages bounded by bytes
with the log-probabilities as stored, never parsed; a batch file's size and a job read without parsing them;
every line the same JSON as a result's row makes."""

from __future__ import annotations

import json
import time
import tracemalloc
import uuid

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_app
from api.service.batch_output import completion, lines, size
from jobs.tables import Job, Result
from tests.api_keys import AUTH
from tests.batch_waits import ingested
from tests.service_settings import settings_for
from tests.sql import sql
from tests.test_batch_ingest import jsonl, line, upload

MB = 10**6


def logprobs(tokens: int) -> list[dict]:
    """OpenAI's `logprobs.content` for `tokens` tokens, 20 alternatives each: ~1 kB a token."""
    def entry(i: int, j: int) -> dict:
        return {"token": f"t{i}.{j}", "logprob": -0.125 * j, "bytes": [116, 48 + j % 10]}

    return [{**entry(i, 0), "top_logprobs": [entry(i, j) for j in range(20)]} for i in range(tokens)]


def answered(database: str, client: TestClient, items: int, tokens: int, n: int = 1) -> str:
    """A batch of `items` succeeded items, each with `n` answers of `tokens` tokens' log-probabilities."""
    batch = ingested(client, upload(client, jsonl([line(i) for i in range(items)])).json()["id"])
    choice = {"text": "other é \"answer\"", "reasoning": None, "completion_tokens": 3, "finish_reason": "length",
              "tool_calls": None}
    engine = sa.create_engine(database)
    with engine.begin() as conn:
        ids = conn.execute(sa.text(
            "UPDATE jobs SET status = 'succeeded', finished_at = CURRENT_TIMESTAMP RETURNING id")).scalars()
        ids = [uuid.UUID(str(job_id)) for job_id in ids]  # SQLite hands back the hex
        conn.execute(sa.insert(Result), [{
            "job_id": job_id, "text": f"answer {i}\n\u2028", "reasoning": "why", "prompt_tokens": 7,
            "completion_tokens": 9, "finish_reason": "stop", "chunks": 1, "levels": 1,
            "logprobs": logprobs(tokens), "tool_calls": None,
            "choices": [{**choice, "logprobs": logprobs(tokens) if k % 2 else None} for k in range(n - 1)] or None}
            for i, job_id in enumerate(ids)])
    engine.dispose()
    return batch["id"]


def peak_while(work) -> tuple[object, int]:
    tracemalloc.start()
    try:
        done = work()
        return done, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_output_lines_are_the_rows_json_with_the_logprobs_as_stored(any_database, broker, tiny_model):
    database = any_database
    settings = settings_for(database, broker, tiny_model)
    app = create_app(settings)
    with TestClient(app) as client:
        batch_id = answered(database, client, 3, 5, n=3)
        body = client.get(f"/v1/batches/{batch_id}/output", headers=AUTH).content
        file = client.get(f"/v1/files/file-{uuid.UUID(batch_id).hex}-output", headers=AUTH).json()
    got = [json.loads(x) for x in body.decode().splitlines()]
    with app.state.sessions() as session:
        rows = session.execute(sa.select(Job, Result).join(Result, Result.job_id == Job.id)
                               .order_by(Job.custom_id)).all()
        want = [completion(job, result, settings.model) for job, result in rows]
    assert [line["response"]["body"] for line in got] == want  # what the parsed row gives, choice by choice
    assert [c["logprobs"] is None for c in want[0]["choices"]] == [False, True, False]
    assert file["bytes"] == len(body)


def test_output_pages_are_bounded_in_bytes_and_hold_no_parsed_logprobs(database, broker, tiny_model):
    settings = settings_for(database, broker, tiny_model)
    app = create_app(settings)
    with TestClient(app) as client:
        batch_id = uuid.UUID(answered(database, client, 8, 2000))  # ~2 MB of log-probabilities a line
        stored = sql(database, "SELECT sum(octet_length(logprobs::text)) FROM results")[0][0]
        sent, peak = peak_while(lambda: sum(len(piece) for piece in lines(app.state.sessions, batch_id, False,
                                                                          settings.model)))
        sized, sizing_peak = peak_while(lambda: size(app.state.sessions, batch_id, False, settings.model))
    assert stored > 15 * MB and sent > stored and sized == sent
    assert peak < 0.75 * stored, f"{peak / MB:.0f} MB held for {stored / MB:.0f} MB of log-probabilities"
    assert sizing_peak < MB, f"sizing held {sizing_peak / MB:.1f} MB"  # their lengths, never their text


def test_a_job_with_long_logprobs_is_read_without_parsing_them(database, broker, tiny_model):
    with TestClient(create_app(settings_for(database, broker, tiny_model))) as client:
        answered(database, client, 1, 5000, n=3)  # ~10 MB of log-probabilities
        [(job_id, stored)] = sql(database, "SELECT job_id, octet_length(logprobs::text) + "
                                           "octet_length(choices::text) FROM results")
        start = time.monotonic()
        got, peak = peak_while(lambda: client.get(f"/v1/jobs/{job_id}", headers=AUTH))
        took = time.monotonic() - start
    job = got.json()
    assert got.status_code == 200 and job["status"] == "succeeded", job
    assert job["result"]["logprobs"] == logprobs(5000) and job["result"]["choices"][1]["logprobs"] == logprobs(5000)
    assert job["result"]["choices"][0]["logprobs"] is None and job["result"]["text"] == "answer 0\n\u2028"
    assert peak < 6 * stored, f"{peak / MB:.0f} MB for {stored / MB:.0f} MB stored ({took:.1f} s)"
