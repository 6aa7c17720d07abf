"""`POST /v1/chat/completions` with the real `openai` SDK as the client, against the API and a worker as real
processes: plain and streamed answers, the SDK's typed errors, and a client that goes away cancels its job."""

from __future__ import annotations

import time
import uuid

import openai
import pytest

from api.http.client import Client
from tests.api_keys import API_KEY
from tests.openai_sdk import sdk

HELLO = [{"role": "user", "content": "Hello, where is my parcel?"}]


def job_of(completion_id: str) -> uuid.UUID:
    return uuid.UUID(completion_id.removeprefix("chatcmpl-"))


def test_plain_and_streamed_completions(stack):
    model = stack.env["CONVOQ_MODEL"]
    client = sdk(stack)
    answer = client.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=0)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_headers={"X-Convoq-Priority": "9"},
                                                 extra_body={"conversation_id": "ticket-881"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    with Client(stack.api_url, API_KEY) as ours:
        job = ours.get(job_of(chunks[0].id))
    assert job.priority == 9 and job.status == "succeeded" and job.conversation_id == "ticket-881"
    assert text == job.result.text and finish == [job.result.finish_reason]  # the pieces add up to the answer
    assert chunks[-1].usage.completion_tokens == job.result.completion_tokens


def test_the_sdk_raises_its_typed_errors(stack):
    model = stack.env["CONVOQ_MODEL"]
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "not-a-key-at-all").chat.completions.create(model=model, messages=HELLO)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        sdk(stack).chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        sdk(stack).chat.completions.create(model=model, messages=HELLO, frequency_penalty=0.5)
    with pytest.raises(openai.UnprocessableEntityError, match="priority"):
        sdk(stack).chat.completions.create(model=model, messages=HELLO, metadata={"priority": "urgent"})
    with pytest.raises(openai.BadRequestError, match="less than or equal to 8"):
        sdk(stack).chat.completions.create(model=model, messages=HELLO, n=9)
    # what convoq does not implement is refused by name, not silently dropped
    with pytest.raises(openai.BadRequestError, match="not supported: logit_bias"):
        sdk(stack).chat.completions.create(model=model, messages=HELLO, logit_bias={"42": 5}, user="customer-17")


def test_a_client_that_goes_away_cancels_its_job(paced):
    model = paced.env["CONVOQ_MODEL"]
    stream = sdk(paced).chat.completions.create(model=model, messages=HELLO, max_tokens=900, stream=True)
    seen = [next(iter(stream)) for _ in range(4)]  # the reply is under way
    job_id = job_of(seen[0].id)
    stream.close()
    with Client(paced.api_url, API_KEY) as ours:
        deadline = time.monotonic() + 30
        while (job := ours.get(job_id)).status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.2)
    assert job.status == "cancelled" and job.result.completion_tokens < 900
