"""What a request may hold, checked at the door: JSON schemas of any shape are a 4xx or work (never a 500), a
schema past the settings' bounds is a 400 naming the bound, numbers no float holds are a 400 wherever they sit,
a large schema is checked on a thread (never the event loop) and only once; and a model's `<tool_call>` nested
deeper than JSON may be stays text."""

from __future__ import annotations

import asyncio
import json

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.app import create_app
from api.http import json_body
from api.service.batch_input import parse_lines
from jobs import structured
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.structured import ONE_SCHEMA, SCHEMA_LIST, SCHEMA_MAP, UNENFORCED, SchemaBounds, schema_problem
from jobs.tool_calls import ToolUse, parse
from tests.api_keys import API_KEY, AUTH

HELLO = [{"role": "user", "content": "Hello"}]
DRAFT7 = "http://json-schema.org/draft-07/schema#"


def fmt(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def jobs_stored(database: str) -> int:
    with sa.create_engine(database).connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()


@pytest.fixture
def make_api(database, broker, tiny_model):
    clients = []

    def make(**bounds) -> TestClient:
        app = create_app(Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=str(tiny_model),
                                  **bounds))
        clients.append(client := TestClient(app).__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


# schemas whose keywords have shapes a draft's meta-schema lets through, or refuses
ODD_SHAPES = [
    {"$schema": DRAFT7, "$defs": [1]},
    {"$schema": DRAFT7, "$defs": {"a": 5}, "definitions": {"b": {"type": "string"}}},
    {"$schema": DRAFT7, "properties": {"a": {"type": "string"}}, "patternProperties": {"^x": True}},
    {"$schema": DRAFT7, "items": [{"type": "integer"}, True]},
    {"$schema": "http://json-schema.org/draft-04/schema#", "dependentSchemas": [1], "anyOf": [{}]},
    {"$schema": "not a meta-schema", "prefixItems": {"a": 1}},
    {"$schema": 5, "anyOf": {}},
    {"properties": [1]},
    {"allOf": "x"},
]


@pytest.mark.parametrize("schema", ODD_SHAPES)
def test_a_schema_of_any_shape_is_refused_by_validation_or_accepted(schema):
    try:
        JobIn(messages=HELLO, response_format=fmt(schema))
    except ValidationError as exc:
        assert "schema" in str(exc)


def test_an_unenforced_keyword_is_found_in_a_drafts_list_of_items():
    problem = schema_problem({"$schema": DRAFT7, "items": [{"type": "integer"}, {"uniqueItems": True}]})
    assert problem is not None and problem.startswith("uniqueItems (at items/1/uniqueItems)")


KEYWORDS = sorted(set(UNENFORCED + ONE_SCHEMA + SCHEMA_LIST + SCHEMA_MAP + ("type", "$ref", "$id", "enum")))
DRAFTS = [DRAFT7, "http://json-schema.org/draft-04/schema#", "https://json-schema.org/draft/2020-12/schema", "x"]
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.sampled_from(["#", "object"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from([*KEYWORDS, "a"]), inner,
                                                                        max_size=3)),
    max_leaves=10)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(KEYWORDS), VALUES, max_size=4), st.one_of(st.none(), st.sampled_from(DRAFTS)))
def test_the_schema_check_says_what_is_wrong_of_any_json_or_nothing(schema, draft):
    problem = schema_problem(({"$schema": draft} if draft else {}) | schema)
    assert problem is None or isinstance(problem, str)


def test_odd_shapes_are_a_4xx_or_accepted_never_a_500(make_api):
    api = make_api()
    for schema in ODD_SHAPES:
        r = api.post("/v1/jobs", json={"messages": HELLO, "response_format": fmt(schema)}, headers=AUTH)
        assert r.status_code in (202, 422), (schema, r.text)


@pytest.mark.parametrize("raw", ['{"type": "number", "minimum": 1e400}', '{"type": "number", "maximum": -1e400}',
                                 '{"type": "integer", "minimum": 1' + "0" * 400 + "}",
                                 '{"type": "number", "minimum": NaN}', '{"enum": [Infinity]}'])
def test_a_number_no_float_holds_is_a_400_at_the_door(make_api, database, tiny_model, raw):
    api = make_api()
    body = '{"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema", ' \
           '"json_schema": {"name": "a", "schema": ' + raw + "}}}"
    r = api.post("/v1/jobs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and ("float's range" in r.text or "no JSON number" in r.text), r.text
    chat = body.replace('{"messages"', f'{{"model": {json.dumps(str(tiny_model))}, "messages"', 1)
    r = api.post("/v1/chat/completions", content=chat, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # anywhere in a body, not only in a schema
    r = api.post("/v1/jobs", content='{"messages": [{"role": "user", "content": "Hi"}], "sampling": '
                                     '{"temperature": NaN}}', headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert jobs_stored(database) == 0


def flat(properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_past_a_bound_is_a_400_naming_it_and_one_within_is_taken(make_api, database, tiny_model):
    api = make_api(max_schema_bytes=2048, max_schema_nodes=100, max_schema_depth=8)
    tool = {"type": "function", "function": {"name": "f", "parameters": flat(60)}}
    for body, bound in (({"response_format": fmt(flat(60))}, "CONVOQ_MAX_SCHEMA_NODES"),
                        ({"response_format": fmt(nested(4))}, "CONVOQ_MAX_SCHEMA_DEPTH"),
                        ({"response_format": fmt({"description": "x" * 3000})}, "CONVOQ_MAX_SCHEMA_BYTES"),
                        ({"tools": [tool]}, "CONVOQ_MAX_SCHEMA_NODES")):
        r = api.post("/v1/jobs", json={"messages": HELLO, **body}, headers=AUTH)
        assert r.status_code == 400 and bound in r.json()["detail"], r.text
        r = api.post("/v1/chat/completions", json={"model": str(tiny_model), "messages": HELLO, **body}, headers=AUTH)
        assert r.status_code == 400 and bound in r.json()["error"]["message"], r.text
    assert jobs_stored(database) == 0
    assert api.post("/v1/jobs", json={"messages": HELLO, "response_format": fmt(flat(40))},
                    headers=AUTH).status_code == 202
    # a batch line past a bound is that line's error
    bounds = SchemaBounds(2048, 100, 8)
    lines = [json.dumps({"custom_id": "big", "messages": HELLO, "response_format": fmt(flat(60))}).encode(),
             json.dumps({"custom_id": "ok", "messages": HELLO, "response_format": fmt(flat(4))}).encode()]
    big, ok = parse_lines([b"\n".join(lines)], 1, bounds=bounds)
    assert "CONVOQ_MAX_SCHEMA_NODES" in big.message and ok.custom_id == "ok"


def test_a_large_schema_is_checked_once_and_never_on_the_event_loop(make_api, monkeypatch):
    api = make_api()
    checks: list[bool] = []
    check = structured.schema_problem

    def watched(schema):
        try:
            asyncio.get_running_loop()
            checks.append(True)
        except RuntimeError:  # no loop runs on this thread
            checks.append(False)
        return check(schema)

    monkeypatch.setattr(structured, "schema_problem", watched)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                               for i in range(300)}}
    assert json_body.INLINE_BYTES < len(json.dumps(schema, separators=(",", ":"))) < Settings().max_schema_bytes
    r = api.post("/v1/jobs", json={"messages": HELLO, "response_format": fmt(schema)}, headers=AUTH)
    assert r.status_code == 202, r.text
    assert checks == [False]
    r = api.post("/v1/jobs", json={"messages": HELLO, "response_format": fmt(schema | {"minProperties": "x"})},
                 headers=AUTH)
    assert r.status_code == 422 and "minProperties" in r.text and checks == [False, False]


def test_a_tool_call_nested_deeper_than_json_may_be_stays_text():
    deep = "[" * 5000 + "]" * 5000
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"x": {deep}}}}}\n</tool_call>'
    assert parse(text, ToolUse(frozenset({"f"}))) == (text, None)
    fine = '<tool_call>\n{"name": "f", "arguments": {"x": [[1]]}}\n</tool_call>'
    assert parse(fine, ToolUse(frozenset({"f"})))[1][0]["function"]["arguments"] == '{"x": [[1]]}'
