"""Batch uploads are validated line by line: good lines become jobs, bad ones are reported with a reason."""

from __future__ import annotations

import json

from api.service.batch_input import OpenAIBody, parse_batch
from jobs.schemas import Sampling

# a value for every sampling field, none of them its default
EVERY_FIELD = Sampling(max_new_tokens=7, temperature=0.5, top_p=0.8, top_k=3, min_p=0.1, repetition_penalty=1.1,
                       presence_penalty=0.2, stop=["END", "###"], seed=4, speculative="off")


def openai_line(custom_id: str, content: str = "Summarize: my parcel is late.", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "qwen3", "messages": [{"role": "user", "content": content}], **body}}


def jsonl(*objs) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs) + b"\n"


def test_openai_lines_become_chat_jobs_with_their_sampling():
    parsed, errors, total = parse_batch(jsonl(
        openai_line("a", max_tokens=40, temperature=0.7, stop="END", seed=3),
        openai_line("b", max_completion_tokens=12, top_p=0.9, conversation_id="ticket-881"),
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                              {"type": "text", "text": "part two"}]}]}},
    ), priority=2)
    assert errors == [] and total == 3
    a, b, c = (p.job for p in parsed)
    assert a.kind == "chat" and a.priority == 2
    assert (a.sampling.max_new_tokens, a.sampling.temperature, a.sampling.stop, a.sampling.seed) == (40, 0.7, ["END"], 3)
    assert (b.sampling.max_new_tokens, b.sampling.top_p) == (12, 0.9)
    assert (a.conversation_id, b.conversation_id) == (None, "ticket-881")  # convoq's extension: affinity
    assert c.messages[0].content == "part one, part two"
    assert [p.line for p in parsed] == [1, 2, 3]


def test_our_lines_transcripts_are_summaries_and_messages_are_chats():
    parsed, errors, _ = parse_batch(jsonl(
        {"custom_id": "t1", "transcript": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"custom_id": "t2", "transcript": "customer: my card is blocked", "max_new_tokens": 20},
        {"custom_id": "m1", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "conv-9"},
    ), priority=1)
    assert errors == []
    kinds = {p.custom_id: p.job for p in parsed}
    assert kinds["t1"].kind == "summarize" and kinds["t2"].kind == "summarize"
    assert kinds["t2"].sampling.max_new_tokens == 20
    assert kinds["m1"].kind == "chat" and kinds["m1"].conversation_id == "conv-9"


def test_our_lines_carry_every_sampling_field_stop_included():
    assert set(EVERY_FIELD.model_fields_set) == set(Sampling.model_fields)
    line = {"custom_id": "s", "messages": [{"role": "user", "content": "hi"}], **EVERY_FIELD.model_dump()}
    parsed, errors, _ = parse_batch(jsonl(line), priority=1)
    assert errors == [] and parsed[0].job.sampling == EVERY_FIELD


def test_openai_lines_carry_every_sampling_field_by_openai_names():
    # an OpenAI body can say every sampling field: the output budget by OpenAI's names, the others by ours
    assert set(Sampling.model_fields) - {"max_new_tokens"} <= set(OpenAIBody.model_fields)
    body = {**EVERY_FIELD.model_dump(exclude={"max_new_tokens"}), "max_completion_tokens": EVERY_FIELD.max_new_tokens}
    parsed, errors, _ = parse_batch(jsonl(openai_line("s", **body)), priority=1)
    assert errors == [] and parsed[0].job.sampling == EVERY_FIELD


def test_each_bad_line_is_reported_and_the_rest_survive():
    data = jsonl(
        openai_line("ok-1"),
        b'{"custom_id": "broken", "body": ',
        openai_line("wrong-url") | {"url": "/v1/embeddings"},
        openai_line("wrong-method") | {"method": "GET"},
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}},
        openai_line("ok-1"),
        openai_line("bad-role") | {"body": {"messages": [{"role": "robot", "content": "x"}]}},
        openai_line("too-many", max_tokens=10**7),
        openai_line("nine-choices", n=9),
        openai_line("image") | {"body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
        {"custom_id": "nothing"},
        b"[1, 2, 3]",
        b"\xff\xfe not utf-8",
        b"",
        openai_line("ok-2"),
    )
    parsed, errors, total = parse_batch(data, priority=1)
    assert [p.custom_id for p in parsed] == ["ok-1", "ok-2"]
    assert total == 14  # the blank line is not a request
    by_line = {e.line: e for e in errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert "invalid JSON" in by_line[2].message
    assert "/v1/chat/completions" in by_line[3].message and by_line[3].custom_id == "wrong-url"
    assert "POST" in by_line[4].message
    assert "custom_id" in by_line[5].message
    assert "duplicate" in by_line[6].message
    assert "role" in by_line[7].message
    assert "max_new_tokens" in by_line[8].message
    assert "n" in by_line[9].message
    assert "text" in by_line[10].message
    assert "transcript" in by_line[11].message
    assert "JSON object" in by_line[12].message
    assert "UTF-8" in by_line[13].message


def test_openai_options_convoq_does_not_implement_are_refused_by_name_never_ignored():
    ignored = dict(user="customer-17", store=True, service_tier="auto", metadata={"ticket": "T-1"})
    off = dict(logprobs=False, top_logprobs=None, tools=[], response_format={"type": "text"}, tool_choice="none",
               parallel_tool_calls=True, stream=False)
    parsed, errors, _ = parse_batch(jsonl(
        openai_line("ok", **ignored, **off),
        openai_line("bias", logit_bias={"42": 5}),
        openai_line("audio", modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}),
        openai_line("typo", max_token=40),
    ), priority=2)
    assert [p.custom_id for p in parsed] == ["ok"]
    assert parsed[0].job.conversation_id is None
    refused = {e.custom_id: e.message for e in errors}
    assert set(refused) == {"bias", "audio", "typo"}
    assert "not supported: logit_bias " in refused["bias"]
    assert "not supported: audio, modalities " in refused["audio"]
    assert "not supported: max_token " in refused["typo"]
