"""Property-based fuzzing of the API: whatever arrives, the answer is never a 5xx and nothing bad is queued."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from jobs.settings import Settings
from tests.api_keys import API_KEY, AUTH, auth

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "USER", 3, None])
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": st.text(max_size=60) | st.integers() | st.none()}),
                    max_size=4)
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(-5, 10**7) | st.text(max_size=4),
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | st.none(),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-10, 10**6),
    "stop": st.lists(st.text(max_size=80), max_size=10) | st.text(max_size=5),
    "seed": st.integers(-(2**70), 2**70),
})
jobs = st.fixed_dictionaries({"messages": messages}, optional={
    "kind": st.sampled_from(["chat", "summarize", "other"]) | json_values,
    "priority": st.integers(-3, 12) | st.floats() | st.text(max_size=3),
    "conversation_id": st.text(max_size=200) | st.none(),
    "idempotency_key": st.text(max_size=200),
    "sampling": sampling | json_values,
    "extra": json_values,
})
bodies = jobs.map(lambda j: json.dumps(j).encode()) | json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200)


@pytest.fixture(scope="module")
def client(tiny_models, postgres_url, redis_url, tmp_path_factory):
    from migrations.apply import upgrade
    from tests.conftest import _new_database

    database = _new_database(postgres_url)
    upgrade(database)
    app = create_app(Settings(database_url=database, broker_url=redis_url, api_keys=API_KEY,
                              model=str(tiny_models["tiny"]), rate_limit_per_s=1e6, rate_limit_burst=10**6))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_post_jobs_never_5xx(client, body):
    r = client.post("/v1/jobs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    assert r.status_code in (200, 202, 400, 409, 413, 422)
    if r.status_code == 409:  # only an idempotency key sent before with another job conflicts
        assert "idempotency_key" in json.loads(body) and "used for a different job" in r.text, (body, r.text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job_id=st.text(max_size=50), wait=st.text(max_size=6) | st.floats().map(str))
def test_get_jobs_never_5xx(client, job_id, wait):
    r = client.get(f"/v1/jobs/{quote(job_id, safe='')}", params={"wait": wait}, headers=AUTH)
    assert r.status_code < 500, (job_id, wait, r.status_code, r.text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(upload=st.binary(max_size=300), priority=st.text(max_size=3))
def test_post_batches_never_5xx(client, upload, priority):
    r = client.post("/v1/batches", files={"file": ("x.jsonl", upload)}, data={"priority": priority}, headers=AUTH)
    assert r.status_code < 500, (upload, r.status_code, r.text)


def test_every_v1_route_refuses_missing_wrong_and_wrong_scope_keys(tiny_models, postgres_url, redis_url):
    from migrations.apply import upgrade
    from tests.conftest import _new_database

    database = _new_database(postgres_url)
    upgrade(database)
    app = create_app(Settings(database_url=database, broker_url=redis_url, model=str(tiny_models["tiny"]),
                              api_keys="reader-key-0123456789:read,submitter-0123456789:submit",
                              auth_failures_burst=10**6))  # many wrong keys on purpose: not the limiter's test
    scope_of = {"get": "read", "post": "submit", "delete": "submit"}
    with TestClient(app) as c:
        routes = [(path, method) for path, item in c.get("/openapi.json").json()["paths"].items()
                  for method in item if path.startswith("/v1/")]
        assert len(routes) >= 8
        for path, method in routes:
            url = path.replace("{job_id}", "00000000-0000-0000-0000-000000000000").replace(
                "{batch_id}", "00000000-0000-0000-0000-000000000000")
            other = "submitter-0123456789" if scope_of[method] == "read" else "reader-key-0123456789"
            for headers, expected in [({}, 401), (auth("not-a-key"), 401),
                                      ({"Authorization": "Basic cmVhZGVyLWtleS0wMTIzNDU2Nzg5"}, 401),
                                      (auth(other), 403)]:
                r = c.request(method.upper(), url, headers=headers)
                assert r.status_code == expected, (method, path, headers, r.status_code)
