"""Stopping requests inside the engine: cancels and deadlines free their KV blocks at once and keep the text
so far; earlier deadlines are admitted first; a job's run stops all of its requests, later ones included."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from itertools import pairwise

import pytest

from engine.interface import Request
from engine.runtime.engine_thread import EngineThread
from jobs.schemas import JobIn, Message
from jobs.settings import Settings
from tests.engine_helpers import greedy, make_engine, prompts
from worker.bridge import Bridge
from worker.summarize import summarize

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_cancel_stops_a_request_before_the_next_step_and_frees_its_blocks(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=4)
    thread = EngineThread(engine)
    seen: list[int] = []

    def on_tokens(tokens: list[int]) -> None:  # runs on the engine thread, right after a step
        seen.append(len(tokens))
        if len(tokens) >= 8:
            thread.cancel("long")

    try:
        other = thread.submit(Request("other", prompts(1, 20, 20, seed=2)[0], greedy(40)))
        long = thread.submit(Request("long", prompts(1, 20, 20, seed=1)[0], greedy(500)), on_tokens)
        cancelled = long.result(timeout=120)
        # the cancel came after the step that made token 8; no step ran in between
        assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) == seen[-1] >= 8
        assert cancelled.text  # the text so far is kept
        assert seen == sorted(seen) and all(b - a >= thread.progress_every for a, b in pairwise(seen))
        assert other.result(timeout=120).finish_reason == "length"  # its batch-mate was not disturbed
        stats = thread.stats()
        assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
    finally:
        thread.close()


def test_a_request_past_its_deadline_expires_with_its_text_so_far(tiny_model):
    engine = make_engine(tiny_model)
    thread = EngineThread(engine)
    try:
        soon = time.monotonic() + 0.5
        running = thread.submit(Request("slow", prompts(1, 20, 20)[0], greedy(1000), deadline=soon))
        late = thread.submit(Request("late", prompts(1, 20, 20)[0], greedy(8), deadline=time.monotonic() - 1))
        gone = late.result(timeout=60)
        assert gone.finish_reason == "expired" and gone.token_ids == []  # never ran
        done = running.result(timeout=120)
        assert time.monotonic() >= soon
        assert done.finish_reason == "expired" and 0 < len(done.token_ids) < 1000
        assert thread.stats().running == 0
    finally:
        thread.close()


def test_within_one_priority_earlier_deadlines_are_admitted_first(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=1)
    now = time.monotonic()
    for rid, deadline in (("none", None), ("later", now + 600), ("sooner", now + 300)):
        engine.add_request(Request(rid, prompts(1, 12, 12)[0], greedy(2), priority=3, arrival=now, deadline=deadline))
    order = []
    while engine.has_unfinished():
        order += [c.request_id for c in engine.step()]
    assert order == ["sooner", "later", "none"]


def test_stopping_a_run_stops_every_part_of_a_map_reduce_summary(tiny_model):
    bridge = Bridge(EngineThread(make_engine(tiny_model)), Settings())
    turns = [Message(role="user" if i % 2 == 0 else "assistant", content=f"({i}) the router drops the line "
                     "every evening, the light blinks orange and the port was reset twice") for i in range(200)]
    job = JobIn(kind="summarize", priority=1, messages=turns, sampling={"max_new_tokens": 200})
    outcome = {}
    try:
        with bridge.run("job-1", job, datetime.now(UTC)) as run:
            worker = threading.Thread(target=lambda: outcome.setdefault("o", summarize(run)))
            worker.start()
            deadline = time.monotonic() + 60
            while bridge.stats().running < 2 and time.monotonic() < deadline:  # its parts are in the engine
                time.sleep(0.01)
            assert bridge.stop(["job-1", "some-other-job"]) == ["job-1"]
            worker.join(60)
            # anything the run submits after the stop ends at once, without reaching the engine
            late = run.submit("9:9", prompts(1, 10, 10)[0]).result(timeout=1)
        assert outcome["o"].completion.finish_reason == "cancelled" and late.finish_reason == "cancelled"
        stats = bridge.stats()
        assert stats.running == 0 and stats.waiting == 0
        assert bridge.running() == []
    finally:
        bridge.close()
