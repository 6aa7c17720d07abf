"""Map-reduce summaries of transcripts longer than the model's context, on the tiny model."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from engine.runtime.engine_thread import EngineThread
from jobs.chat import chat_for
from jobs.schemas import JobIn, Message
from worker.bridge import Bridge
from worker.engine_factory import WorkerSettings, load_backend
from worker.outcome import Outcome
from worker.summarize import plan_chunks, split_turn, summarize

NOW = datetime.now(UTC)


@pytest.fixture(scope="module", params=["engine", "hf"])
def bridge(request, tiny_model):
    settings = WorkerSettings(model=str(tiny_model), backend=request.param, device="cpu")
    b = Bridge(EngineThread(load_backend(settings)), settings)
    yield b
    b.close()


def transcript(turns: int) -> list[Message]:
    lines = [
        "My router keeps dropping the connection every evening around eight, and I work from home.",
        "I'm sorry about that. Let's check the line: could you read me the light pattern on the front?",
        "The power light is green, the internet light blinks orange, then goes green after a minute.",
        "Thanks. I see three resyncs yesterday. I'll reset the port and send a replacement filter.",
    ]
    return [Message(role="user" if i % 2 == 0 else "assistant", content=f"({i}) {lines[i % 4]}") for i in range(turns)]


def summary_job(turns: list[Message], max_new_tokens: int) -> JobIn:
    return JobIn(kind="summarize", priority=1, messages=turns, sampling={"max_new_tokens": max_new_tokens})


def run(kind, bridge: Bridge, job_id: str, job: JobIn, created: datetime) -> Outcome:
    """Run `job` the way the worker does: `kind` (reply or summarize) on the job's run of the bridge."""
    with bridge.run(job_id, job, created) as job_run:
        return kind(job_run)


arrivals: list[float] = []  # the engine-clock arrival of every request `spy_prompts` saw


def spy_prompts(bridge: Bridge, monkeypatch) -> list[int]:
    """Record the prompt length of every request the bridge sends to the engine."""
    lengths: list[int] = []
    arrivals.clear()
    submit = bridge.runner.submit

    def recording(request, on_tokens=None):
        lengths.append(len(request.prompt_ids))
        arrivals.append(request.arrival)
        return submit(request, on_tokens)

    monkeypatch.setattr(bridge.runner, "submit", recording)
    return lengths


def test_short_transcript_is_one_request(bridge, monkeypatch):
    lengths = spy_prompts(bridge, monkeypatch)
    outcome = run(summarize, bridge, "short", summary_job(transcript(6), 16), NOW)
    assert outcome.completion.ok and outcome.completion.text
    assert (outcome.chunks, outcome.levels) == (1, 1) and len(lengths) == 1


def test_transcript_five_times_the_context_goes_through_map_reduce(bridge, monkeypatch):
    turns = transcript(250)
    whole = len(bridge.prompt_ids(chat_for(job := summary_job(turns, 48)), job, False))
    assert whole > 5 * bridge.max_model_len
    lengths = spy_prompts(bridge, monkeypatch)
    max_new = 48
    outcome = run(summarize, bridge, "long", summary_job(turns, max_new), NOW)
    assert outcome.completion.ok, outcome.completion.error
    assert outcome.chunks >= 5 and outcome.levels >= 2
    assert len(lengths) >= outcome.chunks + 1
    assert max(lengths) <= bridge.max_model_len - max_new  # every prompt left room for its output
    assert outcome.completion.prompt_tokens == sum(lengths)
    assert len(outcome.completion.token_ids) <= max_new
    # the parts ran side by side: the job's prefill and decode are wall time along its levels, within its run
    timings = outcome.completion.timings
    assert 0 < timings.prefill_ms + timings.decode_ms <= outcome.engine_ms


def test_chunks_keep_every_turn_in_order_and_split_only_oversized_turns():
    def fits(turns):
        return sum(len(t.content.split()) for t in turns) <= 10

    turns = [Message(role="user", content="a b c"), Message(role="assistant", content=" ".join("x" * 25)),
             Message(role="user", content="d e")]
    chunks = plan_chunks(turns, fits)
    assert all(fits(c) for c in chunks)
    flat = [t for c in chunks for t in c]
    assert " ".join(t.content for t in flat).split() == " ".join(t.content for t in turns).split()
    assert len(split_turn(turns[1], fits)) == 4 and flat[0] == turns[0]


def test_a_turn_without_spaces_is_split_between_characters(bridge):
    """Chinese and Japanese text has no spaces to split a long turn on; it is cut between characters instead."""
    cjk = "我的路由器每天晚上八点左右都会断线，我在家工作。ルーターが毎晩切れます。" * 40
    turns = [Message(role="user", content="短い"), Message(role="user", content=cjk)]
    chunks = plan_chunks(turns, lambda ts: sum(len(t.content) for t in ts) <= 300)
    assert "".join(t.content for c in chunks for t in c) == "短い" + cjk
    assert all(sum(len(t.content) for t in c) <= 300 for c in chunks) and len(chunks) >= len(cjk) // 300
    # and a whole summary of it goes through map-reduce on the model, in parts that fit its context
    outcome = run(summarize, bridge, "cjk", summary_job([Message(role="user", content=cjk * 3)], 32), NOW)
    assert outcome.completion.ok, outcome.completion.error
    assert outcome.chunks > 1


def test_chunks_are_as_large_as_fits_with_few_prompt_checks():
    import itertools
    import random

    rng = random.Random(0)
    turns = [Message(role="user", content=" ".join("w" * rng.randint(1, 9))) for _ in range(400)]
    calls = 0

    def fits(ts):
        nonlocal calls
        calls += 1
        return sum(len(t.content.split()) for t in ts) <= 120

    chunks = plan_chunks(turns, fits)
    # one check per turn (is it oversized?), then about 2 log2(turns in a chunk) per chunk, not one per turn
    assert calls < len(turns) + 12 * len(chunks) < 2 * len(turns)
    assert [t for c in chunks for t in c] == turns
    # greedy and maximal: every chunk fits, and would not with the next turn added
    assert all(fits(c) for c in chunks) and all(not fits([*c, n[0]]) for c, n in itertools.pairwise(chunks))


def test_a_budget_too_small_to_combine_fails_clearly(bridge):
    outcome = run(summarize, bridge, "hopeless", summary_job(transcript(120), 480), NOW)
    assert outcome.completion.finish_reason == "error"
    assert "max_new_tokens" in outcome.completion.error


def test_a_chat_that_cannot_fit_fails_with_the_reason_the_api_gives(bridge, monkeypatch):
    from jobs.chat import problem
    from worker.reply import reply

    job = JobIn(messages=[{"role": "user", "content": "where is my parcel " * 200}], sampling={"max_new_tokens": 64})
    lengths = spy_prompts(bridge, monkeypatch)
    outcome = run(reply, bridge, "too-long", job, NOW)
    assert outcome.completion.finish_reason == "error" and not outcome.completion.retryable
    assert outcome.completion.error == problem(job, bridge.tokenizer, bridge.max_model_len, False)[1]
    assert lengths == []  # refused before the engine saw it


def test_the_engine_counts_a_jobs_wait_from_its_creation(bridge, monkeypatch):
    """Time in the broker ages a request like time in the engine: its arrival is the job's creation."""
    import time

    from worker.reply import reply

    spy_prompts(bridge, monkeypatch)
    created = datetime.now(UTC) - timedelta(seconds=30)
    job = JobIn(messages=[{"role": "user", "content": "Where is my parcel?"}], sampling={"max_new_tokens": 4})
    outcome = run(reply, bridge, "waited", job, created)
    assert outcome.completion.ok
    [arrival] = arrivals
    assert 29 < time.monotonic() - arrival < 60
    assert outcome.completion.timings.queue_wait_ms >= 30_000 and outcome.completion.timings.ttft_ms >= 30_000
