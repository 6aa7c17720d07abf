"""The producer API in-process, against real PostgreSQL and Redis: validation, auth, idempotency."""

from __future__ import annotations

import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.app import create_app
from bench.statements import Statements
from broker.redis_layout import broker_priority
from jobs.settings import Settings
from tests.api_keys import ADMIN_KEY, API_KEY, AUTH, auth

READ_KEY = "reader-key-0123456789"
GOOD = {"messages": [{"role": "user", "content": "Where is my parcel?"}], "priority": 7}


@pytest.fixture
def client(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=f"{API_KEY},{READ_KEY}:read,{ADMIN_KEY}:admin",
                        model=str(tiny_model), rate_limit_per_s=50, rate_limit_burst=60, max_request_bytes=64 * 1024)
    with TestClient(create_app(settings)) as c:
        yield c


def queued_messages(broker_url: str) -> int:
    r = redis.Redis.from_url(broker_url)
    return sum(r.llen(k) for k in r.keys("convoq.*") if r.type(k) == b"list")


def job_rows(database_url: str) -> int:
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()
    engine.dispose()
    return n


def test_submit_commits_row_and_publishes_with_broker_priority(client, database, broker):
    r = client.post("/v1/jobs", json=GOOD, headers=AUTH)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "queued" and body["created"] is True
    job = client.get(f"/v1/jobs/{body['id']}", headers=AUTH).json()
    assert job["status"] == "queued" and job["priority"] == 7 and job["result"] is None
    # priority 7 (ours) is broker priority 2: the message sits on the `:2` list of the interactive queue
    r = redis.Redis.from_url(broker)
    assert r.llen(f"convoq.interactive:{broker_priority(7)}") == 1
    assert job_rows(database) == 1


def test_jobs_go_to_the_queue_of_their_class(client, broker):
    """Below the interactive priority (7) a job is bulk, whatever its kind; from it, interactive."""
    for kind, priority in (("summarize", 0), ("chat", 3), ("summarize", 9)):
        r = client.post("/v1/jobs", json={**GOOD, "kind": kind, "priority": priority}, headers=AUTH)
        assert r.status_code == 202
    r = redis.Redis.from_url(broker)
    assert r.llen("convoq.bulk:9") == 1 and r.llen(f"convoq.bulk:{broker_priority(3)}") == 1
    assert r.llen("convoq.interactive") == 1  # priority 9 is broker level 0: the bare list


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"priority": 10}, "priority"),
        ({"priority": -1}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"kind": "translate"}, "kind"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": ""}]}, "content"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "messages"),
        ({"sampling": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"sampling": {"max_new_tokens": 10**6}}, "max_new_tokens"),
        ({"sampling": {"temperature": -0.5}}, "temperature"),
        ({"sampling": {"temperature": 1e9}}, "temperature"),
        ({"sampling": {"top_p": 0}}, "top_p"),
        ({"sampling": {"top_k": -3}}, "top_k"),
        ({"sampling": {"stop": [""]}}, "stop"),
        ({"sampling": {"seed": -1}}, "seed"),
        ({"sampling": {"beams": 4}}, "beams"),
        ({"conversation_id": "has spaces"}, "conversation_id"),
        ({"idempotency_key": "x" * 500}, "idempotency_key"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_invalid_fields_get_422_naming_them_and_enqueue_nothing(client, database, broker, patch, field):
    r = client.post("/v1/jobs", json={**GOOD, **patch}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert field in r.text
    assert queued_messages(broker) == 0
    assert job_rows(database) == 0


def test_malformed_json_is_422(client, broker):
    r = client.post("/v1/jobs", content=b'{"messages": [', headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422
    assert queued_messages(broker) == 0


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": f"Basic {API_KEY}"}])
def test_every_v1_route_needs_a_valid_key(client, database, broker, headers):
    assert client.post("/v1/jobs", json=GOOD, headers=headers).status_code == 401
    assert client.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=headers).status_code == 401
    assert queued_messages(broker) == 0 and job_rows(database) == 0


def test_unknown_job_is_404(client):
    assert client.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=AUTH).status_code == 404
    assert client.get("/v1/jobs/not-a-uuid", headers=AUTH).status_code == 422


def test_idempotency_key_returns_the_same_job_once(client, database, broker):
    job = {**GOOD, "idempotency_key": "order-42:reply-1"}
    first = client.post("/v1/jobs", json=job, headers=AUTH)
    second = client.post("/v1/jobs", json=job, headers=AUTH)
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"] and second.json()["created"] is False
    assert job_rows(database) == 1 and queued_messages(broker) == 1


def test_published_jobs_are_stamped_as_they_are_inserted(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=str(tiny_model))
    app = create_app(settings)
    statements = Statements(app.state.db_engine)
    with TestClient(app) as c:
        ids = [c.post("/v1/jobs", json=GOOD, headers=AUTH).json()["id"] for _ in range(5)]
    writes = [s.split(None, 2)[:2] for s in statements.sent]
    # a submission is one write: the insert, stamp included (no UPDATE of the row after its message went out)
    assert [w for w in writes if w[0] in ("INSERT", "UPDATE")] == [["INSERT", "INTO"]] * 5
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, published_at FROM jobs")).all()
    engine.dispose()
    assert sorted(str(r.id) for r in rows) == sorted(ids) and all(r.published_at is not None for r in rows)
    assert queued_messages(broker) == 5


def test_broker_down_keeps_the_job_queued_and_unpublished(database, redis_url):
    settings = Settings(database_url=database, broker_url="redis://127.0.0.1:1/0", api_keys=API_KEY)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/jobs", json=GOOD, headers=AUTH)
        assert r.status_code == 202
        assert c.get("/healthz").status_code == 503
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        status, published = conn.execute(sa.text("SELECT status, published_at FROM jobs")).one()
    engine.dispose()
    assert status == "queued" and published is None


def test_an_api_that_dies_between_the_commit_and_the_send_loses_no_job(database, broker, tiny_model, monkeypatch):
    """The row is committed stamped published, then the process dies before its message goes out (the client may
    even have had no 202): the sweep finds a sent job with no message and sends it, once, after two sweeps."""
    from api.service import jobs as service
    from bench.audit import messages_by_job
    from broker.app import create_celery
    from store.connections import make_db_engine, make_sessions
    from worker.sweep import Sweeper

    settings = Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=str(tiny_model),
                        unpublished_grace_s=0)
    monkeypatch.setattr(service, "publish", lambda *args, **kwargs: [])  # dead before the send
    with TestClient(create_app(settings)) as c:
        job_id = c.post("/v1/jobs", json=GOOD, headers=AUTH).json()["id"]
    monkeypatch.undo()
    assert queued_messages(broker) == 0
    engine = make_db_engine(database)
    sweeper = Sweeper(make_sessions(engine), create_celery(settings), settings)
    first, second, third = (sweeper.sweep(force=True) for _ in range(3))
    engine.dispose()
    assert (first["published"], first["awaiting_confirmation"]) == (0, 1)  # maybe still on its way
    assert second["published"] == 1 and third["published"] == 0
    client = redis.Redis.from_url(broker)
    assert {str(i): len(m) for i, m in messages_by_job(client, settings).items()} == {job_id: 1}
    client.close()


def test_healthz_and_openapi(client):
    assert client.get("/healthz").json() == {"database": "ok", "broker": "ok"}
    spec = client.get("/openapi.json").json()
    assert "/v1/jobs" in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_prompt_longer_than_the_context_is_422(client, database, broker):
    long = {**GOOD, "messages": [{"role": "user", "content": "refund " * 1200}]}
    r = client.post("/v1/jobs", json=long, headers=AUTH)
    assert r.status_code == 422 and "context" in r.text and "messages" in r.text
    fits_alone = {**GOOD, "messages": [{"role": "user", "content": "refund " * 400}], "sampling": {"max_new_tokens": 900}}
    r = client.post("/v1/jobs", json=fits_alone, headers=AUTH)
    assert r.status_code == 422 and "max_new_tokens 900" in r.text
    summary = {**GOOD, "kind": "summarize", "sampling": {"max_new_tokens": 1000}}
    r = client.post("/v1/jobs", json=summary, headers=AUTH)
    assert r.status_code == 422 and "max_new_tokens" in r.text
    assert queued_messages(broker) == 0 and job_rows(database) == 0


def test_oversized_body_is_413_before_anything_is_read(client, broker):
    huge = {**GOOD, "messages": [{"role": "user", "content": "x" * 100_000}]}
    r = client.post("/v1/jobs", json=huge, headers=AUTH)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]
    assert queued_messages(broker) == 0


def test_scopes_rate_limits_and_wrong_scope(database, broker, tiny_model):
    # a slow refill (one request per 5 s), so the bucket cannot refill while the test runs, however slow
    settings = Settings(database_url=database, broker_url=broker,
                        api_keys=f"{API_KEY}@shop,{READ_KEY}:read@shop,{ADMIN_KEY}:admin",
                        model=str(tiny_model), rate_limit_per_s=0.2, rate_limit_burst=10)
    read = auth(READ_KEY)
    admin = auth(ADMIN_KEY)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/jobs", json=GOOD, headers=read)
        assert r.status_code == 403 and "submit" in r.json()["detail"]
        assert client.post("/v1/jobs", json=GOOD, headers=admin).status_code == 202  # admin may do everything
        job_id = client.post("/v1/jobs", json=GOOD, headers=AUTH).json()["id"]  # the shop's, as is the reader
        assert client.get(f"/v1/jobs/{job_id}", headers=admin).status_code == 200  # admin sees every tenant
        codes = [client.get(f"/v1/jobs/{job_id}", headers=read).status_code for _ in range(12)]
        # a refused scope takes no token: the burst of ten reads goes through, then the bucket is empty
        assert codes == [200] * 10 + [429] * 2
        limited = client.get(f"/v1/jobs/{job_id}", headers=read)
        assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
        assert client.get(f"/v1/jobs/{job_id}", headers=AUTH).status_code == 200  # other keys are unaffected
