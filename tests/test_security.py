"""Security in-process against real PostgreSQL and Redis: refused before reading, tenants isolated,
idempotency per tenant, failed keys rate-limited per address, secrets kept out of the logs."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import request_hash
from tests.api_keys import ADMIN_KEY, API_KEY, auth
from tests.batch_waits import ingested

MIB = 2**20
SHOP_KEY, SHOP_READER = "shop-key-0123456789", "shop-reader-0123456789"
BANK_KEY = "bank-key-0123456789"
KEYS = f"{SHOP_KEY}@shop,{SHOP_READER}:read@shop,{BANK_KEY}@bank,{ADMIN_KEY}:admin"
GOOD = {"messages": [{"role": "user", "content": "Where is my parcel?"}], "priority": 7}


# --- refuse before reading ----------------------------------------------------------------------------------

def call(app, headers: dict[str, str], body_bytes: int, declare_length: bool = True,
         path: str = "/v1/batches") -> tuple[int, int]:
    """Send a POST to `path` of `body_bytes` straight to the ASGI app, 1 MiB per `receive()`; (status, bytes
    the app actually took from the request stream)."""
    taken = 0
    sent_chunks = 0
    chunks = body_bytes // MIB
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if declare_length:
        raw.append((b"content-length", str(body_bytes).encode()))
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("test", 80),
             "client": ("198.51.100.7", 5000), "headers": raw}

    async def receive() -> dict:
        nonlocal taken, sent_chunks
        if sent_chunks >= chunks:
            return {"type": "http.disconnect"}
        sent_chunks += 1
        taken += MIB
        return {"type": "http.request", "body": b"x" * MIB, "more_body": sent_chunks < chunks}

    status = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    asyncio.run(app(scope, receive, send))
    return status[0], taken


@pytest.fixture
def bare_app(tmp_path, tiny_model):
    """The app without its lifespan: the gate answers before any route (or database) is reached."""
    return create_app(Settings(database_url=f"sqlite:///{tmp_path}/c.db", model=str(tiny_model), api_keys=KEYS,
                               max_upload_bytes=8 * MIB, max_request_bytes=2 * MIB))


def test_a_50_mib_upload_with_a_wrong_key_is_refused_without_reading_its_body(bare_app):
    multipart = {"Content-Type": "multipart/form-data; boundary=x"}
    assert call(bare_app, {**multipart, **auth("wrong-key-0123456789")}, 50 * MIB) == (401, 0)
    assert call(bare_app, multipart, 50 * MIB) == (401, 0)  # no key at all
    assert call(bare_app, {**multipart, **auth(SHOP_READER)}, 50 * MIB) == (403, 0)  # a key without `submit`
    # a good key, but a declared length over the upload limit: refused unread too
    assert call(bare_app, {**multipart, **auth(SHOP_KEY)}, 50 * MIB) == (413, 0)


def test_a_body_without_a_length_is_stopped_at_the_limit(bare_app):
    status, taken = call(bare_app, {"Content-Type": "application/json", **auth(SHOP_KEY)}, 50 * MIB,
                         declare_length=False, path="/v1/jobs")
    assert status == 413 and taken <= 2 * MIB + MIB  # CONVOQ_MAX_REQUEST_BYTES, then one chunk more at most


# --- tenants ------------------------------------------------------------------------------------------------

@pytest.fixture
def client(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=KEYS, model=str(tiny_model))
    with TestClient(create_app(settings)) as c:
        yield c


def batch_of(client: TestClient, key: str) -> str:
    lines = b"\n".join(json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": "hi"}]}).encode()
                       for i in range(3)) + b'\n{"custom_id": "bad"}\n'
    r = client.post("/v1/batches", files={"file": ("b.jsonl", lines)}, headers=auth(key))
    assert r.status_code == 202, r.text
    ingested(client, r.json()["id"], key)
    return r.json()["id"]


def test_two_tenants_cannot_see_or_touch_each_others_jobs_and_batches(client):
    job = client.post("/v1/jobs", json=GOOD, headers=auth(SHOP_KEY)).json()["id"]
    batch = batch_of(client, SHOP_KEY)
    file_id = client.post("/v1/files", files={"file": ("f.jsonl", b"{}\n")}, data={"purpose": "batch"},
                          headers=auth(SHOP_KEY)).json()["id"]
    bank = auth(BANK_KEY)
    for method, path in [("GET", f"/v1/jobs/{job}"), ("GET", f"/v1/jobs/{job}/events"),
                         ("POST", f"/v1/jobs/{job}/cancel"), ("GET", f"/v1/batches/{batch}"),
                         ("POST", f"/v1/batches/{batch}/cancel"), ("POST", f"/v1/batches/{batch}/retry"),
                         ("GET", f"/v1/batches/{batch}/output"), ("GET", f"/v1/batches/{batch}/errors"),
                         ("GET", f"/v1/batches/{batch}/line_errors"), ("GET", f"/v1/files/{file_id}"),
                         ("GET", f"/v1/files/{file_id}/content"), ("DELETE", f"/v1/files/{file_id}"),
                         ("GET", f"/v1/files/file-{uuid.UUID(batch).hex}-errors")]:
        r = client.request(method, path, headers=bank)
        assert r.status_code == 404, (method, path, r.status_code)  # not 403: its existence is not revealed
    assert client.get("/v1/batches", headers=bank).json()["data"] == []
    assert client.get("/v1/files", headers=bank).json()["data"] == []
    assert client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
                       headers=bank).status_code == 404
    # untouched: the shop's job is still queued, its batch still open
    assert client.get(f"/v1/jobs/{job}", headers=auth(SHOP_READER)).json()["status"] == "queued"
    shop_batch = client.get(f"/v1/batches/{batch}", headers=auth(SHOP_READER)).json()
    assert shop_batch["status"] in ("validating", "in_progress") and shop_batch["request_counts"]["invalid"] == 1
    # a key of the same tenant sees everything of it; admin sees every tenant
    listed = client.get(f"/v1/batches/{batch}/line_errors", headers=auth(SHOP_READER)).json()
    assert [(e["line"], e["custom_id"]) for e in listed["data"]] == [(4, "bad")]
    assert client.get(f"/v1/jobs/{job}", headers=auth(ADMIN_KEY)).status_code == 200
    assert [b["id"] for b in client.get("/v1/batches", headers=auth(ADMIN_KEY)).json()["data"]] == [batch]


def test_line_errors_are_paged_by_line_number(client):
    lines = b"\n".join(b'{"custom_id": "bad-%d"}' % i for i in range(25))
    batch = client.post("/v1/batches", files={"file": ("b.jsonl", lines)}, headers=auth(SHOP_KEY)).json()["id"]
    ingested(client, batch, SHOP_KEY)
    seen, after = [], 0
    while True:
        page = client.get(f"/v1/batches/{batch}/line_errors", params={"after": after, "limit": 10},
                          headers=auth(SHOP_KEY)).json()
        seen += [e["line"] for e in page["data"]]
        if not page["has_more"]:
            break
        after = int(page["last_id"])
    assert seen == list(range(1, 26))
    got = client.get(f"/v1/batches/{batch}", headers=auth(SHOP_KEY)).json()
    assert got["status"] == "failed" and got["request_counts"]["invalid"] == 25 and "errors" not in got


def test_idempotency_keys_are_per_tenant_and_a_different_body_is_409(client):
    job = {**GOOD, "idempotency_key": "order-42:reply-1"}
    shop = client.post("/v1/jobs", json=job, headers=auth(SHOP_KEY))
    bank = client.post("/v1/jobs", json=job, headers=auth(BANK_KEY))
    assert shop.status_code == bank.status_code == 202
    assert shop.json()["id"] != bank.json()["id"]  # never another tenant's job id
    again = client.post("/v1/jobs", json=job, headers=auth(SHOP_KEY))
    assert again.status_code == 200 and again.json()["id"] == shop.json()["id"]
    changed = {**job, "messages": [{"role": "user", "content": "Cancel my order"}]}
    conflict = client.post("/v1/jobs", json=changed, headers=auth(SHOP_KEY))
    assert conflict.status_code == 409 and "idempotency_key" in conflict.json()["detail"]


# --- brute force ----------------------------------------------------------------------------------------------

def test_failed_authentications_are_rate_limited_per_address(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=KEYS, model=str(tiny_model),
                        auth_failures_burst=5, auth_failures_per_s=0.01)
    app = create_app(settings)
    with TestClient(app, client=("203.0.113.9", 4000)) as attacker, \
            TestClient(app, client=("203.0.113.10", 4000)) as neighbour:
        codes = [attacker.get("/v1/batches", headers=auth(f"guess-{i:016d}")).status_code for i in range(8)]
        assert codes == [401] * 5 + [429] * 3
        limited = attacker.get("/v1/batches", headers=auth(f"guess-{9:016d}"))
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1  # unknown keys no longer checked
        assert neighbour.get("/v1/batches", headers=auth(SHOP_KEY)).status_code == 200  # another address


def test_a_valid_key_is_never_refused_for_failures_from_its_address(database, broker, tiny_model):
    """Behind a proxy every client shares its address: one client's bad key must not lock the others out."""
    settings = Settings(database_url=database, broker_url=broker, api_keys=KEYS, model=str(tiny_model),
                        auth_failures_burst=2, auth_failures_per_s=0.01)
    with TestClient(create_app(settings), client=("10.0.0.1", 4000)) as proxy:
        for i in range(5):
            proxy.get("/v1/batches", headers=auth(f"guess-{i:016d}"))
        assert proxy.get("/v1/batches", headers=auth(f"guess-{9:016d}")).status_code == 429
        assert proxy.get("/v1/batches", headers=auth(SHOP_KEY)).status_code == 200
        assert proxy.get("/v1/batches", headers=auth(BANK_KEY)).status_code == 200


def test_convoq_api_believes_forwarded_addresses_only_from_the_named_proxies(monkeypatch):
    import uvicorn

    from cli.main import api

    given = {}
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: given.update(kwargs))
    monkeypatch.setenv("CONVOQ_FORWARDED_ALLOW_IPS", "10.1.2.3,192.168.0.0/16")
    api(port=8123)
    assert given["proxy_headers"] is True and given["forwarded_allow_ips"] == "10.1.2.3,192.168.0.0/16"


def test_behind_the_proxy_failures_are_counted_per_forwarded_client(service_env, tmp_path):
    import httpx

    from cli.stack import Stack

    env = {**service_env, "CONVOQ_API_KEYS": KEYS, "CONVOQ_AUTH_FAILURES_BURST": "2",
           "CONVOQ_AUTH_FAILURES_PER_S": "0.01", "CONVOQ_FORWARDED_ALLOW_IPS": "127.0.0.1"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()

        def get(client: str, key: str) -> int:
            headers = {**auth(key), "X-Forwarded-For": client}
            return httpx.get(f"{stack.api_url}/v1/batches", headers=headers, timeout=10).status_code

        assert [get("203.0.113.1", f"guess-{i:016d}") for i in range(3)] == [401, 401, 429]
        assert get("203.0.113.2", f"guess-{0:016d}") == 401  # another client behind the same proxy
        assert get("203.0.113.1", SHOP_KEY) == 200  # a valid key, even from the client that failed


def test_a_tenant_is_never_told_of_another_tenants_cached_prompt(service_env, tmp_path):
    """Tenant B sends tenant A's exact prompt right after A: none of it comes from A's prefix cache, where A
    sending it again reuses it; so neither the counters nor the time to first token confirm a guess."""
    from api.http.client import Client
    from cli.stack import Stack

    secret = {"messages": [{"role": "user", "content": "My account number is 4417 1234 5678 9113 and my name is "
                                                       "Jane Q. Doe; please move 2,400 euros to my savings."}],
              "priority": 9, "sampling": {"max_new_tokens": 4}}
    with Stack({**service_env, "CONVOQ_API_KEYS": KEYS}, tmp_path / "logs") as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, SHOP_KEY) as shop, Client(stack.api_url, BANK_KEY) as bank:

            def reused(client: Client) -> tuple[int, int, int]:
                job = client.wait(client.submit(JobIn.model_validate(secret)).id, timeout=120)
                assert job.status == "succeeded", job
                return job.timings.prompt_tokens_reused, job.timings.host_tokens_reused, job.result.prompt_tokens

            assert reused(bank)[:2] == (0, 0)
            assert reused(shop)[:2] == (0, 0)
            again, _, prompt_tokens = reused(bank)
            assert again == (prompt_tokens - 1) // 16 * 16 > 0  # the tenant's own blocks, as before


# --- secrets --------------------------------------------------------------------------------------------------

def test_secrets_never_appear_in_the_logs(database, tiny_model, caplog):
    password = "s3cret-broker-pass"
    settings = Settings(database_url=database, broker_url=f"redis://:{password}@127.0.0.1:1/0",
                        api_keys=KEYS, model=str(tiny_model))
    with caplog.at_level(logging.DEBUG):
        logging.getLogger(__name__).info("starting with %s", settings)
        with TestClient(create_app(settings)) as c:
            assert c.post("/v1/jobs", json=GOOD, headers=auth(SHOP_KEY)).status_code == 202  # publish fails
            assert c.get("/healthz").status_code == 503
            assert c.get("/metrics").status_code == 200  # the broker is left out, with a warning
            assert c.get("/v1/batches", headers=auth("wrong-key-0123456789")).status_code == 401
    assert "published 0 of 1 jobs" in caplog.text  # the failures were logged ...
    for secret in (password, SHOP_KEY, "wrong-key-0123456789", API_KEY):
        assert secret not in caplog.text  # ... without a secret in them


def test_uploads_past_the_line_limit_are_refused_and_store_nothing(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=KEYS, model=str(tiny_model),
                        max_batch_lines=3)
    line = b'{"custom_id": "c%d", "messages": [{"role": "user", "content": "hi"}]}'
    four = b"\n".join(line % i for i in range(4))
    three = b"\n\n".join(line % i for i in range(3)) + b"\n\n"  # blank lines do not count
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/batches", files={"file": ("b.jsonl", four)}, headers=auth(SHOP_KEY))
        assert r.status_code == 413 and "at most 3 lines" in r.json()["detail"]
        assert c.get("/v1/batches", headers=auth(SHOP_KEY)).json()["data"] == []
        file_id = c.post("/v1/files", files={"file": ("f.jsonl", four)}, data={"purpose": "batch"},
                         headers=auth(SHOP_KEY)).json()["id"]
        r = c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"},
                   headers=auth(SHOP_KEY))
        assert r.status_code == 400 and "at most 3" in r.json()["detail"]
        ok = c.post("/v1/batches", files={"file": ("b.jsonl", three)}, headers=auth(SHOP_KEY))
        assert ok.status_code == 202
        batch = ingested(c, ok.json()["id"], SHOP_KEY)
        assert batch["request_counts"]["total"] == 3 and batch["request_counts"]["invalid"] == 0


def test_tenants_are_not_shown_which_host_runs_their_job(client, database):
    import sqlalchemy as sa

    job = client.post("/v1/jobs", json=GOOD, headers=auth(SHOP_KEY)).json()["id"]
    engine = sa.create_engine(database)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET status = 'running', worker = 'convoq-41@gpu-host-7' WHERE id = :id"),
                     {"id": job})
    engine.dispose()
    assert client.get(f"/v1/jobs/{job}", headers=auth(SHOP_KEY)).json()["worker"] is None
    assert client.post(f"/v1/jobs/{job}/cancel", headers=auth(SHOP_KEY)).json()["worker"] is None
    assert client.get(f"/v1/jobs/{job}", headers=auth(ADMIN_KEY)).json()["worker"] == "convoq-41@gpu-host-7"
    documented = client.get("/openapi.json").json()["components"]["schemas"]["JobOut"]["properties"]["worker"]
    assert "admin" in documented["description"]


def test_a_request_that_uses_none_of_the_later_fields_hashes_as_before_they_existed():
    """An idempotent request sent again across the deploys that added choices, structured outputs, logprobs, tools
    and a job's own speculation switch still matches the hash stored for it (the value computed before they existed); using one of them does
    make it another request."""
    plain = dict(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], priority=7,
                 idempotency_key="k1", sampling={"temperature": 0.5, "stop": ["x"]})
    assert request_hash(JobIn(**plain)) == "db077f6c8cfca68db2cd3f5db0b2b42a37a0c87627fb4b75465df4becd296e62"
    for later in ({"n": 2}, {"logprobs": True}, {"response_format": {"type": "json_object"}}):
        assert request_hash(JobIn(**plain, **later)) != request_hash(JobIn(**plain))
    speculating = dict(plain, sampling={**plain["sampling"], "speculative": "off"})
    assert request_hash(JobIn(**speculating)) != request_hash(JobIn(**plain))
