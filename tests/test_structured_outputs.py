"""Structured outputs and logprobs: a `response_format` checked at the door and made the engine's grammar (a
summary's final request only), log-probabilities in OpenAI's shape from the worker to every answer, and the
official `openai` SDK against the API and a worker as real processes."""

from __future__ import annotations

import json
import math
import time
import uuid
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Literal

import jsonschema
import openai
import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import insert
from transformers import AutoTokenizer

from api.app import create_app
from api.http.client import Client
from api.schemas.results import ResultOut
from cli.stack import Stack
from engine.grammar import Grammars
from engine.interface import ANY_OBJECT, Completion, EngineStats, GrammarKind, GrammarSpec
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Job, Result, job_row, utcnow
from store.connections import make_db_engine, make_sessions
from tests import openai_sdk
from tests.api_keys import API_KEY, AUTH
from worker import results
from worker.bridge import Bridge
from worker.claims import claim
from worker.engine_factory import WorkerSettings
from worker.grammar_spec import grammar_spec
from worker.logprobs import FLOOR, openai_logprobs
from worker.outcome import Outcome
from worker.sampling import sampling_params
from worker.summarize import summarize

HELLO = [{"role": "user", "content": "Hello, where is my parcel?"}]
# bounded everywhere (lengths, ranges, enums), so that even random weights complete it within a small budget
TICKET = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "other"]},
        "resolved": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
        "note": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,8}$"}, {"type": "null"}]},
    },
    "required": ["category", "resolved", "priority", "tags", "note"],
    "additionalProperties": False,
}
TICKET_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET, "strict": True}}
# valid JSON Schema (Python's `re` takes lookbehind) that xgrammar cannot compile
UNCOMPILABLE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}}}
NOT_A_SCHEMA = {"type": "object", "properties": {"priority": {"type": "integer", "minimum": "one"}}}


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


# --- the contract: what a job may ask for, and the grammar it becomes ----------------------------------------


def test_a_response_format_becomes_a_compact_spec_keeping_the_schemas_order():
    job = JobIn(messages=HELLO, response_format=TICKET_FORMAT)
    spec = grammar_spec(job)
    assert spec.kind is GrammarKind.JSON_SCHEMA and json.loads(spec.schema) == TICKET
    assert ", " not in spec.schema and ": " not in spec.schema  # compact: one schema sent twice is one spec
    # the grammar emits properties in the schema's order: sorting the keys would reorder the answer
    assert list(json.loads(spec.schema)["properties"]) == list(TICKET["properties"])
    assert JobIn.model_validate(job.model_dump(mode="json")) == job  # the stored payload reads back the same
    assert grammar_spec(JobIn(messages=HELLO, response_format={"type": "json_object"})) == \
        GrammarSpec(GrammarKind.JSON_SCHEMA, ANY_OBJECT)
    assert grammar_spec(JobIn(messages=HELLO, response_format={"type": "text"})) is None
    assert grammar_spec(JobIn(messages=HELLO)) is None


@pytest.mark.parametrize(("fields", "says"), [
    ({"response_format": fmt(NOT_A_SCHEMA)}, r"not a valid JSON schema: 'one' is not of type 'number' "
                                             r"\(at properties/priority/minimum\)"),
    ({"response_format": fmt({"type": "objekt"})}, "not a valid JSON schema"),
    ({"response_format": {"type": "xml"}}, "does not match any of the expected tags"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "name"),
    ({"response_format": fmt({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})},
     r"uniqueItems \(at properties/tags/uniqueItems\) cannot be enforced"),
    ({"response_format": fmt({"$defs": {"x": {"anyOf": [{"if": {"type": "string"}}]}}})},
     r"if \(at \$defs/x/anyOf/0/if\) cannot be enforced"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
])
def test_the_job_contract_refuses(fields, says):
    with pytest.raises(ValidationError, match=says):
        JobIn(messages=HELLO, **fields)


def test_a_property_named_like_an_unenforced_keyword_is_only_a_name():
    named = {"type": "object", "properties": {"contains": {"type": "string"}, "if": {"type": "boolean"}},
             "additionalProperties": {"type": "array", "uniqueItems": False}}
    assert JobIn(messages=HELLO, response_format=fmt(named)).response_format is not None


def test_a_schema_is_checked_against_its_own_drafts_meta_schema():
    draft4 = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}}}
    with pytest.raises(ValidationError, match="not a valid JSON schema"):  # draft 2020-12 unless it says
        JobIn(messages=HELLO, response_format=fmt(draft4))
    draft4["$schema"] = "http://json-schema.org/draft-04/schema#"
    assert JobIn(messages=HELLO, response_format=fmt(draft4)).response_format is not None


def test_the_engines_sampling_carries_the_grammar_and_the_logprobs():
    plain = sampling_params(JobIn(messages=HELLO))
    assert (plain.grammar, plain.grammar_after_think, plain.logprobs) == (None, False, None)
    job = JobIn(messages=HELLO, response_format=TICKET_FORMAT, logprobs=True, top_logprobs=5)
    assert json.loads(sampling_params(job).grammar.schema) == TICKET
    assert (sampling_params(job).logprobs, sampling_params(job).grammar_after_think) == (5, False)
    assert sampling_params(job, thinking=True).grammar_after_think  # the reasoning runs free
    assert sampling_params(JobIn(messages=HELLO, logprobs=True)).logprobs == 0  # the tokens' own, no alternatives
    assert not sampling_params(JobIn(messages=HELLO, logprobs=True), thinking=True).grammar_after_think


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}}


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["format", "calls-or-format"])
def test_a_schema_is_parsed_once_from_the_jobs_payload_to_its_compiled_grammar(tiny_model, monkeypatch, tools):
    """Reading the stored payload back is the one parse; each schema is then written as text once, and that text
    is what the compiler gets."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    payload = json.dumps({"messages": HELLO, "response_format": TICKET_FORMAT, "tools": tools})
    JobIn.model_validate(json.loads(payload))  # what validating loads once per process (meta-schemas) is loaded
    parsed, written = [], []
    decode, dumps = json.JSONDecoder.decode, json.dumps
    monkeypatch.setattr(json.JSONDecoder, "decode", lambda self, text, **kw: parsed.append(text) or decode(self, text))
    monkeypatch.setattr(json, "dumps", lambda value, *args, **kw: (
        written.append(value) if isinstance(value, dict) else None) or dumps(value, *args, **kw))
    spec = grammar_spec(JobIn.model_validate(json.loads(payload)))
    assert grammars.compiled(spec) is not None
    assert parsed == [payload]
    assert written == [TICKET] + [tool["function"]["parameters"] for tool in tools or ()]


class Instant:
    """An engine that answers every request at once with a short text, keeping what it was asked."""

    alive = True

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len, self.requests = tokenizer, max_model_len, []

    def submit(self, request, on_tokens=None) -> Future:
        self.requests.append(request)
        future: Future = Future()
        future.set_result(Completion(request.request_id, [5, 6], "{}", len(request.prompt_ids), "stop",
                                     logprobs=None if request.sampling.logprobs is None else [(-0.1, []), (-0.2, [])]))
        return future

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self) -> None:
        pass


def test_a_long_transcripts_parts_run_free_and_only_its_final_summary_is_constrained(tiny_model):
    runner = Instant(AutoTokenizer.from_pretrained(tiny_model), max_model_len=300)
    bridge = Bridge(runner, WorkerSettings(model=str(tiny_model), device="cpu"))
    turns = [{"role": "user" if i % 2 == 0 else "assistant",
              "content": f"({i}) My router drops the connection every evening around eight, and I work from home."}
             for i in range(30)]
    job = JobIn(kind="summarize", messages=turns, sampling={"max_new_tokens": 32}, response_format=TICKET_FORMAT,
                logprobs=True)
    try:
        with bridge.run("j", job, datetime.now(UTC)) as run:
            outcome = summarize(run)
    finally:
        bridge.close()
    assert outcome.completion.ok and outcome.chunks > 1
    *parts, final = runner.requests
    assert parts and all(r.sampling.grammar is None and r.sampling.logprobs is None for r in parts)
    assert json.loads(final.sampling.grammar.schema) == TICKET and final.sampling.logprobs == 0
    assert len(outcome.logprobs) == 2  # the final summary's


# --- logprobs in OpenAI's shape ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_model):
    return AutoTokenizer.from_pretrained(qwen3_model)


def test_logprobs_are_openais_with_each_tokens_exact_bytes(qwen3_tokenizer):
    answer = '{"clef": "𝄞"}'  # a character that spans tokens: their texts hold U+FFFD, their bytes add up
    ids = qwen3_tokenizer.encode(answer)
    logprobs = [(-0.25 * i, [(t, -0.25 * i), (ids[0], -math.inf)]) for i, t in enumerate(ids)]
    content = openai_logprobs(qwen3_tokenizer, Completion("j", ids, answer, 3, "stop", logprobs=logprobs), False)
    assert len(content) == len(ids)
    assert b"".join(bytes(t["bytes"]) for t in content).decode() == answer
    assert any("\ufffd" in t["token"] for t in content)  # OpenAI's way with a split character too
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"} and first["token"] == '{"'
    assert first["top_logprobs"][0] == {"token": '{"', "logprob": 0.0, "bytes": list(b'{"')}
    assert content[1]["top_logprobs"][1]["logprob"] == FLOOR  # JSON has no -Infinity: OpenAI's -9999.0
    assert json.loads(json.dumps(content, allow_nan=False)) == content
    assert openai_logprobs(qwen3_tokenizer, Completion("j", ids, answer, 3, "stop"), False) is None


def test_with_thinking_the_logprobs_are_the_answers(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("<think>\nweigh it\n</think>\n\nYes.")
    logprobs = [(-1.0, []) for _ in ids]
    outcome = Outcome.answered(Completion("j", ids, "<think>\nweigh it\n</think>\n\nYes.", 5, "stop",
                                          logprobs=logprobs), 1.0, True, qwen3_tokenizer)
    assert outcome.completion.text == "Yes." and outcome.reasoning == "weigh it"
    assert "".join(t["token"] for t in outcome.logprobs) == "\n\nYes."  # after </think>, none of the reasoning
    unclosed = qwen3_tokenizer.encode("<think>\nstill weighing")  # the budget ran out in the reasoning
    assert Outcome.answered(Completion("j", unclosed, "", 5, "length", logprobs=[(-1.0, [])] * len(unclosed)),
                            1.0, True, qwen3_tokenizer).logprobs == []


def test_the_worker_stores_logprobs_and_a_requests_failure_as_such(database):
    sessions = make_sessions(make_db_engine(database))
    rows = [job_row(JobIn(messages=HELLO, logprobs=True), utcnow()) for _ in range(2)]
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), rows)
    answered, refused = (claim(sessions, str(row["id"]), "w", 3) for row in rows)
    nul = [{"token": "\x00", "logprob": -0.5, "bytes": [0], "top_logprobs": []}]  # a byte-level token: JSON holds it
    results.store(sessions, answered, Outcome(Completion("a", [0], "\x00", 3, "stop"), 1.0, logprobs=nul), "w")
    grammar = Completion.empty("r", 3, "error", "grammar: Lookbehind is not supported yet.")  # the engine refused it
    results.store(sessions, refused, Outcome(grammar, 1.0), "w")
    with sessions() as session:
        stored = ResultOut.model_validate(session.get(Result, answered.job_id), from_attributes=True)
        job = session.get(Job, refused.job_id)
    assert [t.model_dump() for t in stored.logprobs] == nul
    assert (job.error, job.error_code) == ("grammar: Lookbehind is not supported yet.", "invalid_prompt")


# --- the API refuses a bad request before anything is stored -------------------------------------------------


@pytest.fixture
def api(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=str(tiny_model))
    with TestClient(create_app(settings)) as c:
        yield c


def test_the_api_refuses_an_invalid_schema_before_storing_anything(api, database, tiny_model):
    r = api.post("/v1/jobs", json={"messages": HELLO, "response_format": fmt(NOT_A_SCHEMA)}, headers=AUTH)
    assert r.status_code == 422
    [issue] = r.json()["detail"]
    assert issue["loc"][-1] == "schema" and "'one' is not of type 'number'" in issue["msg"]
    r = api.post("/v1/jobs", json={"messages": HELLO, "top_logprobs": 2}, headers=AUTH)
    assert r.status_code == 422 and "top_logprobs needs logprobs" in r.text
    chat = {"model": str(tiny_model), "messages": HELLO}
    for body, says in (({"response_format": fmt(NOT_A_SCHEMA)}, "at properties/priority/minimum"),
                       ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema")):
        r = api.post("/v1/chat/completions", json={**chat, **body}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert says in r.json()["error"]["message"]
    with sa.create_engine(database).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one() == 0
    r = api.post("/v1/jobs", json={"messages": HELLO, "response_format": TICKET_FORMAT, "logprobs": True,
                                   "top_logprobs": 2}, headers=AUTH)
    assert r.status_code == 202, r.text


# --- the official SDK against the service as processes -------------------------------------------------------


@pytest.fixture(scope="module")
def service(tiny_model, postgres_url, redis_url, tmp_path_factory):
    """API + one worker on the tiny random-weight model, one for the module (each costs seconds to start)."""
    from migrations.apply import upgrade
    from tests.conftest import _new_database

    database = _new_database(postgres_url)
    upgrade(database)
    redis.Redis.from_url(redis_url).flushdb()
    env = {"CONVOQ_DATABASE_URL": database, "CONVOQ_BROKER_URL": redis_url, "CONVOQ_MODEL": str(tiny_model),
           "CONVOQ_API_KEYS": API_KEY}
    with Stack(env, tmp_path_factory.mktemp("logs")) as stack:
        stack.start_api()
        stack.start_worker()
        stack.model = str(tiny_model)
        yield stack


@pytest.fixture
def sdk(service) -> openai.OpenAI:
    with openai_sdk.sdk(service) as client:
        yield client


class Ticket(BaseModel):
    category: Literal["billing", "shipping", "other"]
    resolved: bool
    priority: int = Field(ge=1, le=5)
    summary: str = Field(max_length=16)


@pytest.mark.slow
def test_a_json_schema_answer_always_parses_and_validates(service, sdk):
    for seed in range(3):  # random weights sampling at temperature 1: the grammar alone makes it JSON
        answer = sdk.chat.completions.create(model=service.model, messages=HELLO, response_format=TICKET_FORMAT,
                                             max_tokens=120, temperature=1.0, seed=seed)
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].logprobs is None
        jsonschema.validate(json.loads(answer.choices[0].message.content), TICKET)
    parsed = sdk.chat.completions.parse(model=service.model, messages=HELLO, response_format=Ticket, max_tokens=120)
    assert isinstance(parsed.choices[0].message.parsed, Ticket)


@pytest.mark.slow
def test_logprobs_come_in_openais_shape_plain_and_streamed(service, sdk):
    answer = sdk.chat.completions.create(model=service.model, messages=HELLO, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].bytes == token.bytes  # greedy: the most likely token is the one taken
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob >= token.top_logprobs[2].logprob
    chunks = list(sdk.chat.completions.create(model=service.model, messages=HELLO, max_tokens=12, temperature=0,
                                              logprobs=True, stream=True, stream_options={"include_usage": True}))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [len(c.choices[0].logprobs.content) for c in finishing] == [chunks[-1].usage.completion_tokens]
    assert [t.token for t in finishing[0].choices[0].logprobs.content] == [t.token for t in content]
    with Client(service.api_url, API_KEY) as ours:  # a job's result carries them too
        job = ours.get(uuid.UUID(answer.id.removeprefix("chatcmpl-")))
    assert [t.model_dump() for t in job.result.logprobs] == [t.model_dump() for t in content]


@pytest.mark.slow
def test_a_schema_the_compiler_cannot_take_fails_its_request_alone(service, sdk):
    with pytest.raises(openai.BadRequestError, match=r"grammar: .*Lookbehind"):
        sdk.chat.completions.create(model=service.model, messages=HELLO, response_format=fmt(UNCOMPILABLE))
    lines = [{"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": service.model, "messages": HELLO, "max_tokens": 120, **body}}
             for custom_id, body in (("good", {"response_format": TICKET_FORMAT, "logprobs": True}),
                                     ("bad", {"response_format": fmt(UNCOMPILABLE)}))]
    file = sdk.files.create(file=("calls.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                            purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"priority": "9"})
    deadline = time.monotonic() + 120
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    [output] = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    [error] = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    body = output["response"]["body"]
    assert output["custom_id"] == "good"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), TICKET)
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]
    assert error["custom_id"] == "bad" and "grammar: " in error["error"]["message"]
