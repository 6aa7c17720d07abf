"""`n` choices of one prompt: validated everywhere a job comes in; run as one request per choice, the followers
admitted once the first's prompt is in the prefix cache, each seeded with seed + i; stopped together; counted
as OpenAI counts them; shown by the job, the chat completion and the batch output line."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime

import openai
import pytest
from pydantic import ValidationError

from api.http.client import Client
from api.service.batch_input import parse_batch
from api.service.batch_output import completion
from engine.runtime.engine_thread import EngineThread
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Job, Result
from tests.api_keys import API_KEY
from tests.engine_helpers import make_engine
from tests.openai_sdk import sdk
from tests.test_openai_chat import job_of
from worker.bridge import Bridge
from worker.reply import reply

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16  # the engine's KV block size: the prefix cache shares whole blocks
# long enough to fill a few blocks, so that what the followers reuse shows
QUESTION = ("My parcel was marked delivered on Monday but it never arrived; the courier says it was left at the "
            "door, the neighbours saw nothing, and the shop tells me to ask the courier. What can I do now?")


def chat(n: int, max_new_tokens: int = 8, **sampling) -> JobIn:
    return JobIn(messages=[{"role": "user", "content": QUESTION}], priority=9, n=n,
                 sampling={"max_new_tokens": max_new_tokens, **sampling})


def shared_blocks(prompt_tokens: int) -> int:
    """The prompt tokens a follower can take from the cache: its full blocks, short of the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_n_is_validated_wherever_a_job_comes_in():
    for n in (0, 9):
        with pytest.raises(ValidationError, match="n"):
            chat(n)
    with pytest.raises(ValidationError, match="n > 1 is for chat jobs"):
        JobIn(kind="summarize", messages=[{"role": "user", "content": "a transcript"}], n=2)
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}]}}
    parsed, errors, _ = parse_batch(b"\n".join(json.dumps(obj).encode() for obj in (
        {"custom_id": "openai-3", **line, "body": {**line["body"], "n": 3}},
        {"custom_id": "ours-2", "messages": [{"role": "user", "content": "x"}], "n": 2},
        {"custom_id": "openai-9", **line, "body": {**line["body"], "n": 9}},
        {"custom_id": "ours-0", "messages": [{"role": "user", "content": "x"}], "n": 0},
        {"custom_id": "summary-2", "transcript": "a transcript", "n": 2},
    )), priority=1)
    assert [(p.custom_id, p.job.n) for p in parsed] == [("openai-3", 3), ("ours-2", 2)]
    assert [e.custom_id for e in errors] == ["openai-9", "ours-0", "summary-2"]
    assert "n" in errors[0].message and "n > 1 is for chat jobs" in errors[2].message


def test_choices_share_the_prompt_through_the_prefix_cache_and_each_is_seeded(tiny_model):
    bridge = Bridge(EngineThread(make_engine(tiny_model)), Settings())
    job = chat(3, temperature=1.0, seed=2**63 - 2)

    def answer(job_id: str, job: JobIn):
        with bridge.run(job_id, job, datetime.now(UTC)) as run:
            return reply(run)

    try:
        first = answer("job-a", job)
        choices = [first, *first.choices]
        assert [c.completion.request_id for c in choices] == ["job-a", "job-a:1", "job-a:2"]
        prompt = first.completion.prompt_tokens
        # the followers came in once the prompt was cached: the job's timings count what they took from it
        assert first.completion.timings.prompt_tokens_reused >= 2 * shared_blocks(prompt) > 0
        assert first.completion_tokens == sum(len(c.completion.token_ids) for c in choices)
        assert len({tuple(c.completion.token_ids) for c in choices}) > 1  # seeds of their own
        again = answer("job-b", job)
        assert [c.completion.token_ids for c in [again, *again.choices]] == [c.completion.token_ids for c in choices]
        # choice 2 samples with seed + 2, modulo 2**63: what a one-choice job with that seed samples
        alone = answer("job-c", chat(1, temperature=1.0, seed=0))
        assert alone.completion.token_ids == first.choices[1].completion.token_ids and alone.choices == []
    finally:
        bridge.close()


def test_with_no_prefix_cache_to_wait_for_the_choices_start_together(tiny_model):
    bridge = Bridge(EngineThread(make_engine(tiny_model, enable_prefix_cache=False)),
                    Settings().model_copy(update={"backend": "hf"}))  # transformers' keeps no prompt
    try:
        with bridge.run("job-a", chat(3), datetime.now(UTC)) as run:
            outcome = reply(run)
        assert len({c.completion.timings.first_step for c in [outcome, *outcome.choices]}) == 1  # one step
    finally:
        bridge.close()


def test_stopping_a_job_stops_every_choice(tiny_model):
    bridge = Bridge(EngineThread(make_engine(tiny_model)), Settings())
    outcome = {}
    try:
        with bridge.run("job-a", chat(3, max_new_tokens=600, temperature=1.0), datetime.now(UTC)) as run:
            worker = threading.Thread(target=lambda: outcome.setdefault("o", reply(run)))
            worker.start()
            deadline = time.monotonic() + 60
            while bridge.stats().running < 3 and time.monotonic() < deadline:  # every choice is in the engine
                time.sleep(0.01)
            assert bridge.stats().running == 3, "the choices were never all in the engine together"
            assert bridge.stop(["job-a"]) == ["job-a"]
            worker.join(60)
        choices = [outcome["o"], *outcome["o"].choices]
        assert [c.completion.finish_reason for c in choices] == ["cancelled"] * 3
        assert outcome["o"].verdict.finish_reason == "cancelled"
        stats = bridge.stats()
        assert stats.running == 0 and stats.waiting == 0
    finally:
        bridge.close()


def test_a_batch_output_line_carries_every_choice():
    job = Job(id=uuid.uuid4())
    result = Result(text="first", reasoning=None, prompt_tokens=30, completion_tokens=9, finish_reason="stop",
                    created_at=datetime.now(UTC), chunks=1, levels=1,
                    choices=[{"text": "second", "reasoning": None, "finish_reason": "length", "logprobs": None,
                              "tool_calls": None, "completion_tokens": 4}])
    body = completion(job, result, "qwen3")
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "first", "stop"), (1, "second", "length")]
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39}


def test_n_choices_through_the_openai_sdk(paced):
    """With the paced engine every choice runs to max_tokens, so the usage is known; a cancel ends them all."""
    client, model = sdk(paced), paced.env["CONVOQ_MODEL"]
    ask = dict(model=model, messages=[{"role": "user", "content": QUESTION}], n=3, seed=41, temperature=1.0,
               max_tokens=6)
    answer = client.chat.completions.create(**ask)
    assert [(c.index, c.finish_reason) for c in answer.choices] == [(0, "length"), (1, "length"), (2, "length")]
    assert answer.usage.completion_tokens == 3 * 6
    again = client.chat.completions.create(**ask)
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]
    assert len({c.message.content for c in answer.choices}) > 1
    # what a choice carries besides its text, each choice has its own of
    scored = client.chat.completions.create(**{**ask, "n": 2, "logprobs": True, "top_logprobs": 2})
    assert [len(c.logprobs.content) for c in scored.choices] == [6, 6]
    with Client(paced.api_url, API_KEY) as ours:
        job = ours.get(job_of(answer.id))
        assert job.result.prompt_tokens == answer.usage.prompt_tokens  # counted once
        assert job.result.completion_tokens == 18 and [c.completion_tokens for c in job.result.choices] == [6, 6]
        assert [c.text for c in job.result.choices] == [c.message.content for c in answer.choices[1:]]
        assert job.timings.prompt_tokens_reused >= 2 * shared_blocks(job.result.prompt_tokens)

        for refused in (dict(n=0), dict(n=9), dict(n=2, stream=True)):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(**{**ask, **refused})

        job_id = ours.submit(chat(3, max_new_tokens=600)).id
        deadline = time.monotonic() + 30
        while ours.get(job_id).status != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the followers are in the engine
        ours.cancel(job_id)
        job = ours.wait(job_id, timeout=30, poll=1)
    assert job.status == "cancelled"
    assert [c.finish_reason for c in [job.result, *job.result.choices]] == ["cancelled"] * 3
    assert job.result.completion_tokens < 3 * 600
