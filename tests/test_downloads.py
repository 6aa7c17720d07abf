"""Batch output downloads against an API served by uvicorn in this process: clients that read slowly hold no
database connection, every other route keeps answering, and the pages add up to every line once."""

from __future__ import annotations

import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import httpx

from tests.api_keys import ADMIN_KEY, auth
from tests.service_settings import settings_for
from tests.sql import sql
from tests.test_streams import served

ITEMS, FAILED_EVERY, BAD_LINES = 1200, 100, 1500


def make_batch(database: str) -> str:
    """A settled batch of `ITEMS` items with ~8 KB answers (every `FAILED_EVERY`th failed) and `BAD_LINES` bad
    lines, written as the service would have left it."""
    batch = str(uuid.uuid4())
    sql(database, "INSERT INTO batches (id, status, priority, total, metadata, created_at) "
                  "VALUES (:id, 'completed', 1, :n, '{}', now())", id=batch, n=ITEMS + BAD_LINES)
    sql(database, "INSERT INTO jobs (id, status, kind, priority, payload, batch_id, custom_id, attempts, error, "
                  "created_at, finished_at) SELECT gen_random_uuid(), CASE WHEN i % :every = 0 THEN 'failed' "
                  "ELSE 'succeeded' END, 'chat', 1, '{}', :id, 'req-' || lpad(i::text, 5, '0'), 1, "
                  "CASE WHEN i % :every = 0 THEN 'boom' END, now(), now() FROM generate_series(1, :n) i",
        id=batch, n=ITEMS, every=FAILED_EVERY)
    sql(database, "INSERT INTO results (job_id, text, prompt_tokens, completion_tokens, finish_reason, created_at) "
                  "SELECT id, repeat('answer ', 1200), 5, 1200, 'stop', now() FROM jobs "
                  "WHERE batch_id = :id AND status = 'succeeded'", id=batch)
    sql(database, "INSERT INTO batch_line_errors (batch_id, line, custom_id, message) "
                  "SELECT :id, i, NULL, 'not JSON' FROM generate_series(1, :n) i", id=batch, n=BAD_LINES)
    return batch


def slow_reader(url: str, path: str) -> socket.socket:
    """A client that asked for `path`, read its first 4 KB and stopped reading (a small receive window, so the
    server soon cannot send more)."""
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((parts.hostname, parts.port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {ADMIN_KEY}\r\n\r\n".encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    return sock


def in_transaction(database: str) -> int:
    """The database's connections inside a transaction, this one aside: what a reader between pages holds."""
    return sql(database, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()")[0][0]


def test_slow_downloads_hold_no_connection_and_every_route_still_answers(database, broker, tiny_model):
    batch = make_batch(database)
    job = sql(database, "SELECT id FROM jobs LIMIT 1")[0][0]
    output, errors = f"/v1/batches/{batch}/output", f"/v1/files/file-{uuid.UUID(batch).hex}-errors/content"
    with served(settings_for(database, broker, tiny_model)) as (_, url):
        readers = [slow_reader(url, output if i % 2 else errors) for i in range(40)]  # more than the pool holds
        try:
            deadline = time.monotonic() + 10
            while (held := in_transaction(database)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert held == 0, f"{held} connections held by {len(readers)} paused downloads"
            started = time.monotonic()
            r = httpx.get(f"{url}/v1/jobs/{job}", headers=auth(ADMIN_KEY), timeout=10)
            assert r.status_code == 200 and time.monotonic() - started < 5
        finally:
            for sock in readers:
                sock.close()

        with httpx.Client(base_url=url, headers=auth(ADMIN_KEY), timeout=60) as client:
            lines = [json.loads(x) for x in client.get(output).text.splitlines()]
            ids = [x["custom_id"] for x in lines]
            assert len(ids) == ITEMS - ITEMS // FAILED_EVERY and ids == sorted(set(ids))
            assert lines[0]["response"]["body"]["choices"][0]["message"]["content"].startswith("answer answer")
            body = client.get(errors).text
            wrong = [json.loads(x) for x in body.splitlines()]
            assert [x["error"]["code"] for x in wrong] == ["invalid_line"] * BAD_LINES + ["engine_error"] * (
                ITEMS // FAILED_EVERY)
            assert [x["id"] for x in wrong[:BAD_LINES]] == [f"batch_req_line{i}" for i in range(1, BAD_LINES + 1)]
            assert client.get(f"/v1/files/file-{uuid.UUID(batch).hex}-errors").json()["bytes"] == len(body.encode())
