"""Tools: `tools`, `tool_choice` and `tool` messages through the job contract, the chat template, the parse of the
model's `<tool_call>` blocks, the grammar that enforces `required` and a named function, and the whole service
driven by the official `openai` package."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
import xgrammar as xgr
from pydantic import ValidationError

from api.schemas.chat_completion import choice, tool_call_deltas
from api.schemas.results import ChoiceOut
from api.service.batch_input import OpenAIBody, ParsedLine, openai_job, parse_batch
from api.service.batch_output import completion
from api.streams.events import settled
from cli.tiny_model import build_tokenizer, copy_qwen3_tokenizer
from engine.grammar_build import grammar_of
from engine.interface import ANY_OBJECT, Completion, GrammarKind, GrammarSpec
from jobs.chat import chat_for, encode_chat, problem
from jobs.schemas import MAX_TOOLS, JobIn
from jobs.tables import Job, Result, utcnow
from jobs.tool_calls import ToolUse, finish_reason, parse, stream_stops, template_tools, tool_use
from tests.api_keys import AUTH
from tests.conftest import QWEN3_TOKENIZER
from tests.openai_sdk import sdk
from worker.grammar_spec import grammar_spec
from worker.outcome import Outcome
from worker.sampling import sampling_params

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}
TICKET = {"type": "function", "function": {
    "name": "open_ticket", "description": "Open a support ticket",
    "parameters": {"type": "object", "properties": {"priority": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["priority"], "additionalProperties": False}}}
ASK = {"role": "user", "content": "What is the weather in Oslo?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TICKET_TEXT = '<tool_call>\n{"name": "open_ticket", "arguments": {"priority": 2}}\n</tool_call>'
WEATHER_ONLY = ToolUse(frozenset({"get_weather"}))


def job(**fields) -> JobIn:
    return JobIn.model_validate({"messages": [ASK], "tools": [WEATHER, TICKET], **fields})


# --- the contract ---------------------------------------------------------------------------------------------


def test_a_conversation_with_calls_and_their_results_is_a_chat_job():
    done = job(messages=[{"role": "system", "content": "Be brief."}, ASK, CALLED, ANSWERED], tool_choice="auto")
    assert done.messages[-1].role == "tool" and done.messages[2].content is None
    # clients send the content of an assistant turn that only called tools as "" as often as null
    assert job(messages=[ASK, {**CALLED, "content": ""}, ANSWERED]).messages[1].content is None


@pytest.mark.parametrize(("fields", "says"), [
    ({"messages": [ASK, {"role": "tool", "content": "-3 C"}]}, "needs tool_call_id"),
    ({"messages": [{**ASK, "tool_call_id": "call_1"}]}, "only a tool message has one"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_1"}]}, "needs content"),
    ({"messages": [{"role": "assistant"}, ASK]}, "needs content"),
    ({"messages": [{**ASK, "tool_calls": CALLED["tool_calls"]}]}, "only an assistant message has tool_calls"),
    ({"messages": [ASK, CALLED]}, "last message must have role 'user' or 'tool'"),
    ({"tool_choice": {"type": "function", "function": {"name": "refund"}}}, "'refund', which is not among"),
    ({"tools": None, "tool_choice": "required"}, "'required' needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "get_weather is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "should match pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]},
     "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
     f"at most {MAX_TOOLS} items"),
    ({"kind": "summarize", "tool_choice": "auto"}, "tools are for chat jobs"),
])
def test_what_a_tool_request_cannot_be(fields, says):
    with pytest.raises(ValidationError, match=says):
        job(**fields)


def test_openai_bodies_and_batch_lines_carry_tools():
    body = OpenAIBody.model_validate({"messages": [ASK], "tools": [WEATHER], "tool_choice": NAMED,
                                      "parallel_tool_calls": False})
    chat_job = openai_job(body, 5)
    assert chat_job.tool_choice.function.name == "get_weather" and tool_use(chat_job).parallel is False
    lines = [
        {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [ASK, CALLED, ANSWERED], "tools": [WEATHER], "tool_choice": "required"}},
        {"custom_id": "ours", "messages": [ASK], "tools": [WEATHER, TICKET], "tool_choice": "none"},
        {"custom_id": "bad", "messages": [ASK], "tools": [TICKET], "tool_choice": NAMED},
    ]
    parsed, errors, _ = parse_batch("\n".join(json.dumps(line) for line in lines).encode(), 1)
    jobs = {line.custom_id: line.job for line in parsed if isinstance(line, ParsedLine)}
    assert jobs["openai"].tool_choice == "required" and jobs["openai"].messages[2].tool_call_id == "call_1"
    assert len(jobs["ours"].tools) == 2 and template_tools(jobs["ours"]) is None  # `none` shows no tool
    assert [(e.custom_id, "'get_weather', which is not among" in e.message) for e in errors] == [("bad", True)]


# --- the prompt -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    return copy_qwen3_tokenizer(QWEN3_TOKENIZER, tmp_path_factory.mktemp("qwen3-tokenizer"))


def rendered(tokenizer, chat_job: JobIn, thinking: bool = False) -> str:
    return tokenizer.decode(encode_chat(tokenizer, chat_for(chat_job), thinking, template_tools(chat_job)))


def test_qwen3s_template_shows_the_tools_and_the_calls_results(qwen3_tokenizer):
    text = rendered(qwen3_tokenizer, job(messages=[{"role": "system", "content": "Be brief."}, ASK, CALLED, ANSWERED]))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert json.dumps(TICKET) in system and "<tool_call>\n{\"name\": <function-name>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<tools>" not in rendered(qwen3_tokenizer, job(tool_choice="none"))  # OpenAI's: no tool is called


def test_the_tiny_models_template_renders_tools_as_qwen3s(qwen3_tokenizer):
    tiny = build_tokenizer()
    for chat_job in (job(messages=[{"role": "system", "content": "Be brief."}, ASK, CALLED, ANSWERED]),
                     job(messages=[ASK, CALLED, ANSWERED, ANSWERED | {"tool_call_id": "call_2"}]), job(tools=None)):
        # with thinking on, Qwen3's template adds nothing of its own to these chats
        assert rendered(tiny, chat_job, thinking=True) == rendered(qwen3_tokenizer, chat_job, thinking=True)
    assert problem(job(messages=[ASK, CALLED, ANSWERED]), tiny, context=4096, default_thinking=False) is None


# --- the answer -----------------------------------------------------------------------------------------------


def test_calls_are_parsed_out_of_the_answer():
    text, calls = parse("Let me look.\n" + CALL_TEXT, WEATHER_ONLY)
    assert text == "Let me look.\n" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    both = tool_use(job())
    text, calls = parse(f"{CALL_TEXT}\n{TICKET_TEXT}", both)
    assert text == "" and [c["function"]["name"] for c in calls] == ["get_weather", "open_ticket"]
    assert calls[0]["id"] != calls[1]["id"]
    # without parallel calls, a second block is text
    text, calls = parse(f"{CALL_TEXT}\n{TICKET_TEXT}", ToolUse(both.names, parallel=False))
    assert text == f"\n{TICKET_TEXT}" and len(calls) == 1


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "refund", "arguments": {}}\n</tool_call>',  # not one of the tools
    '<tool_call>\n{"name": "get_weather", "arguments": "Oslo"}\n</tool_call>',  # arguments are no object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # cut off by the budget
    "no call at all",
])
def test_what_is_no_call_stays_text(text):
    assert parse(text, WEATHER_ONLY) == (text, None)


def test_a_call_after_a_malformed_block_keeps_the_block_as_text():
    bad = "<tool_call>\nnot json\n</tool_call>"
    text, calls = parse(f"Hm. {bad}\n{CALL_TEXT}\nDone.", WEATHER_ONLY)
    assert text == f"Hm. {bad}\n\nDone." and len(calls) == 1


def test_an_answer_that_called_tools_finishes_with_tool_calls():
    calls = parse(CALL_TEXT, WEATHER_ONLY)[1]
    assert finish_reason("stop", calls) == "tool_calls"
    assert [finish_reason(reason, calls) for reason in ("length", "cancelled")] == ["length", "cancelled"]
    assert finish_reason("stop", None) == "stop"
    done = Completion("r", [1] * 30, "<think>checking</think>\n\n" + CALL_TEXT, 10, "stop")
    outcome = Outcome.answered(done, 1.0, thinking=True, tools=tool_use(job()))
    assert outcome.reasoning == "checking" and outcome.completion.text == "" and len(outcome.tool_calls) == 1
    assert Outcome.answered(done, 1.0, thinking=True).tool_calls is None  # a job without tools: all text


def test_the_openai_objects_carry_the_calls():
    text, calls = parse(CALL_TEXT, WEATHER_ONLY)
    answer = ChoiceOut(text=text, completion_tokens=30, finish_reason="tool_calls", tool_calls=calls)
    message = choice(0, answer)["message"]
    assert message["content"] is None and message["tool_calls"] == calls  # null beside calls alone, as OpenAI's
    assert choice(0, answer.model_copy(update={"text": "Checking."}))["message"]["content"] == "Checking."
    assert tool_call_deltas(answer) == [{"index": 0, **calls[0]}]
    # a batch's output line, read from the stored row
    row = Result(job_id=uuid.uuid4(), text=text, prompt_tokens=5, completion_tokens=30, finish_reason="tool_calls",
                 tool_calls=calls, created_at=utcnow(), chunks=1, levels=1)
    line = completion(Job(id=row.job_id), row, "tiny")["choices"][0]
    assert line["message"]["tool_calls"] == calls and line["finish_reason"] == "tool_calls"


def test_a_stream_holds_back_the_calls():
    stops = stream_stops([], [WEATHER], None)
    assert settled("Let me look.\n" + CALL_TEXT[:30], stops) == "Let me look.\n"
    assert settled("Let me look.\n<tool_c", stops) == "Let me look.\n"
    assert settled("Let me look.\n<tool_c", stream_stops([], [WEATHER], "none")) == "Let me look.\n<tool_c"


# --- the grammar ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler():
    tokenizer = build_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    return xgr.GrammarCompiler(info), info.stop_token_ids[0]


def accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar of `spec` takes `text` whole, ending there."""
    grammars, stop = compiler
    matcher = xgr.GrammarMatcher(grammars.compile_grammar(grammar_of(spec)))
    return matcher.accept_string(text) and matcher.accept_token(stop)


def test_required_is_one_or_more_calls_and_nothing_else(compiler):
    spec = grammar_spec(job(tool_choice="required"))
    assert accepts(compiler, spec, CALL_TEXT) and accepts(compiler, spec, f"{CALL_TEXT}\n{TICKET_TEXT}")
    one = grammar_spec(job(tool_choice="required", parallel_tool_calls=False))
    assert accepts(compiler, one, TICKET_TEXT) and not accepts(compiler, one, f"{CALL_TEXT}\n{TICKET_TEXT}")
    assert not accepts(compiler, spec, "It is cold in Oslo.")
    assert not accepts(compiler, spec, "")
    assert not accepts(compiler, spec, CALL_TEXT + " and some text after it")
    assert not accepts(compiler, spec, CALL_TEXT.replace("Oslo", "Rome"))  # the arguments follow the schema


def test_a_named_function_is_exactly_one_call_of_it(compiler):
    spec = grammar_spec(job(tool_choice=NAMED))
    assert accepts(compiler, spec, CALL_TEXT)
    assert not accepts(compiler, spec, TICKET_TEXT)
    assert not accepts(compiler, spec, f"{CALL_TEXT}\n{CALL_TEXT}")
    params = sampling_params(job(tool_choice=NAMED), thinking=True)
    assert params.grammar == spec and params.grammar_after_think  # the reasoning stays free


def test_auto_is_free_unless_the_answer_has_a_format(compiler):
    assert grammar_spec(job()) is None and grammar_spec(job(tool_choice="auto")) is None
    assert sampling_params(job()).grammar is None
    json_object = {"type": "json_object"}
    spec = grammar_spec(job(response_format=json_object))  # a call, or the answer in its format
    assert accepts(compiler, spec, CALL_TEXT) and accepts(compiler, spec, '{"answer": "cold"}')
    assert not accepts(compiler, spec, "It is cold.")
    # `none`: the format alone; `required`: the call alone
    assert sampling_params(job(tool_choice="none", response_format=json_object)).grammar \
        == GrammarSpec(GrammarKind.JSON_SCHEMA, ANY_OBJECT)
    assert grammar_spec(job(tool_choice="required", response_format=json_object)) \
        == grammar_spec(job(tool_choice="required"))


# --- the service ----------------------------------------------------------------------------------------------


def test_a_named_tool_is_called_and_its_result_answered(stack):
    """The random-weight tiny model still calls the function a request names: the grammar writes the call."""
    model, client = stack.env["CONVOQ_MODEL"], sdk(stack)
    asked = dict(model=model, tools=[WEATHER, TICKET], tool_choice=NAMED, max_tokens=96, temperature=0)
    answer = client.chat.completions.create(messages=[ASK], **asked)
    first = answer.choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    with httpx.Client(base_url=stack.api_url, headers=AUTH) as http:
        stored = http.get(f"/v1/jobs/{uuid.UUID(answer.id.removeprefix('chatcmpl-'))}").json()["result"]
    assert stored["tool_calls"] == [call.model_dump()] and stored["finish_reason"] == "tool_calls"

    # streamed: the call comes as `delta.tool_calls`, which the SDK puts together
    chunks = list(client.chat.completions.create(messages=[ASK], stream=True, **asked))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)  # greedy: the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # the round trip: the call and its result go back, and the model answers
    result = {"role": "tool", "tool_call_id": call.id, "content": "-3 C, snow"}
    reply = client.chat.completions.create(model=model, messages=[ASK, first.message, result], tools=[WEATHER],
                                           tool_choice="none", max_tokens=16, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls


def test_tool_requests_the_service_refuses(stack):
    model, client = stack.env["CONVOQ_MODEL"], sdk(stack)
    with pytest.raises(openai.BadRequestError, match="'refund', which is not among the tools"):
        client.chat.completions.create(model=model, messages=[ASK], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "refund"}})
    with pytest.raises(openai.BadRequestError, match="needs tool_call_id"):
        client.chat.completions.create(model=model, messages=[ASK, CALLED, {"role": "tool", "content": "-3 C"}])
    with httpx.Client(base_url=stack.api_url, headers=AUTH) as http:
        refused = http.post("/v1/jobs", json={"messages": [ASK, CALLED, {"role": "tool", "content": "-3 C"}]})
    assert refused.status_code == 422 and "needs tool_call_id" in refused.text
