"""Scheduling and KV memory: admission within the budget, pool growth, priorities, ageing, the ring."""

from __future__ import annotations

import itertools
import math
import time

import pytest

from engine.core.kv_cache import GROWTH
from engine.core.step_cost import StepCost, Work, work_of
from engine.interface import Request
from tests.engine_helpers import (
    FakeCost,
    greedy,
    kv_block_bytes,
    make_engine,
    prompts,
    run_all,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_pool_too_small_for_everything_at_once(tiny_model):
    budget_blocks = 40
    engine = make_engine(tiny_model, kv_cache_memory=budget_blocks * kv_block_bytes(tiny_model), initial_blocks=4)
    pool = engine.blocks.pools[0]
    capacities = [pool.capacity]

    def check(engine) -> None:
        stats = engine.stats()
        assert stats.kv_blocks_used <= stats.kv_blocks_total <= budget_blocks
        assert engine.memory_report()["pool_bytes"] <= engine.kv_plan.budget_bytes
        if pool.capacity != capacities[-1]:
            capacities.append(pool.capacity)

    # 16 requests of up to 17 blocks each: a few fit at a time
    requests = [Request(str(i), ids, greedy(24)) for i, ids in enumerate(prompts(16, 100, 250))]
    done = run_all(engine, requests, check)
    assert sorted(done) == sorted(r.request_id for r in requests)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in done.values())
    assert engine.stats().kv_blocks_used == 0
    # grew geometrically from the initial size, then once to what the budget leaves while a segment is copied
    # (a step may grow the pool more than once: the first admits several requests)
    assert capacities[-1] == pool.sizes[-1] and set(capacities) <= set(pool.sizes)
    assert budget_blocks - budget_blocks // 8 <= pool.sizes[-1] <= budget_blocks and pool.sizes[0] == 4
    for small, big in itertools.pairwise(pool.sizes[:-1]):
        assert big == math.ceil(small * GROWTH)


def test_priority_request_preempts_and_finishes_first(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=32)
    for i, ids in enumerate(prompts(32, 20, 60)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(40), priority=1))
    for _ in range(3):
        assert engine.step() == []
    assert engine.stats().running == 32
    engine.add_request(Request("urgent", prompts(1, 30, 30, seed=9)[0], greedy(8), priority=9, interactive=True))
    order = list(run_all(engine, []))  # in finishing order
    assert order[0] == "urgent" and len(order) == 33
    assert engine.stats().preemptions >= 1  # every slot was taken: a bulk request made room


def test_ageing_lets_old_work_go_first_within_its_class_but_never_past_interactive(tiny_model):
    def first_admitted(ageing_rate: float, fresh_priority: int) -> str:
        engine = make_engine(tiny_model, max_num_seqs=1, ageing_rate=ageing_rate)
        # waited 100 s at priority 0 against a fresh request
        engine.add_request(Request("old", [5] * 10, greedy(2), priority=0, arrival=time.monotonic() - 100))
        engine.add_request(Request("new", [6] * 10, greedy(2), priority=fresh_priority,
                                   interactive=fresh_priority >= 7))
        engine.step()
        return engine.scheduler.running[0].request_id

    assert first_admitted(ageing_rate=0.0, fresh_priority=5) == "new"
    assert first_admitted(ageing_rate=0.1, fresh_priority=5) == "old"  # 0 + 100 s * 0.1 outranks 5
    assert first_admitted(ageing_rate=0.1, fresh_priority=9) == "new"  # interactive: bulk never ages past it


def test_equal_priority_goes_shortest_first_but_never_past_what_came_a_window_earlier(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=1, ageing_rate=0.0, length_window=30.0)
    now = time.monotonic()
    lengths = {"fresh-long": 200, "short-b": 40, "short-a": 12, "short-c": 90}
    ids = dict(zip(lengths, prompts(4, 10, 10, seed=5), strict=True))
    requests = [Request(name, ids[name] * (n // 10), greedy(3), priority=3, arrival=now)
                for name, n in lengths.items()]
    # a long prompt that arrived more than a window earlier is not overtaken by the short ones
    requests.append(Request("old-long", prompts(1, 200, 200, seed=6)[0], greedy(3), priority=3, arrival=now - 40))
    done = run_all(engine, requests)
    assert list(done) == ["old-long", "short-a", "short-b", "short-c", "fresh-long"]
    assert engine.stats().preemptions == 0


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_sliding_window_blocks_stay_bounded(tiny_models, speculative):
    path = tiny_models["tiny-swa"]  # layers 2-3 attend to the last 64 tokens
    engine = make_engine(path, block_size=16, speculative=speculative)
    window_pool = engine.blocks.pools[engine.windows.index(64)]
    seen = {"window": 0, "full": 0}

    def check(engine) -> None:
        stats = engine.stats()
        seen["window"] = max(seen["window"], stats.kv_window_blocks_used)
        seen["full"] = max(seen["full"], stats.kv_blocks_used - stats.kv_window_blocks_used)

    done = run_all(engine, [Request("long", prompts(1, 20, 20)[0], greedy(600))], check)
    assert len(done["long"].token_ids) == 600
    assert seen["full"] >= 600 // 16  # full attention keeps everything
    if speculative == "off":
        assert seen["window"] <= math.ceil(64 / 16) + 1  # the ring: the window plus the block being filled
    else:  # the window behind a row's first query, plus the row: its last token and its drafts
        assert engine.stats().draft_rows > 0
        assert seen["window"] <= math.ceil((64 + engine.config.speculative_tokens) / 16) + 1
    assert window_pool.num_used == 0


def test_waiting_prompts_are_not_looked_up_while_every_slot_is_taken(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    for i, ids in enumerate(prompts(12, 40, 60)):
        engine.add_request(Request(str(i), ids, greedy(6)))
    lookups = []
    cached_prefix = engine.blocks.cached_prefix
    engine.blocks.cached_prefix = lambda seq: lookups.append(seq) or cached_prefix(seq)
    engine.step()  # admits two; ten wait
    lookups.clear()
    engine.step()  # both slots taken: no admission, so no cache lookups for the waiting ten
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 10
    assert lookups == []
    while engine.has_unfinished():
        engine.step()


def run_until(engine, request_id: str) -> list[str]:
    """Step until `request_id` finishes; returns the ids finished on the way, in order."""
    finished: list[str] = []
    while request_id not in finished:
        finished += [c.request_id for c in engine.step()]
    return finished


def record_plans(engine) -> list[tuple]:
    """From now on, each step's (work, its interactive part's work, bulk entries), as planned."""
    planned = []
    schedule = engine.scheduler.schedule

    def recording(now: float):
        plan = schedule(now)
        if plan is None:
            return None
        interactive = {s.request_id for s in engine.scheduler.running if s.interactive}
        chat = [(start, n) for r, start, n in zip(plan.request_ids, plan.starts.tolist(), plan.counts.tolist(),
                                                  strict=True) if r in interactive]
        contexts = [start + 1 for start, n in chat if n == 1]
        chat_work = Work(sum(n for _, n in chat if n > 1), len(contexts), max(contexts, default=0))
        planned.append((work_of(plan), chat_work, len(plan.request_ids) - len(chat)))
        return plan

    engine.scheduler.schedule = recording
    return planned


def test_steps_with_an_urgent_chat_keep_its_latency_target_and_bulk_fills_the_rest(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=64)
    cost = engine.scheduler.cost = FakeCost()
    planned = record_plans(engine)
    for i, ids in enumerate(prompts(60, 150, 300)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(40), priority=1))
    for _ in range(4):
        engine.step()
    # no interactive traffic yet: bulk gets the whole token budget
    assert planned[0][0].prefill_tokens == engine.config.max_num_batched_tokens
    engine.add_request(Request("chat", prompts(1, 40, 40, seed=9)[0], greedy(12), priority=9, interactive=True))
    del planned[:]
    run_until(engine, "chat")
    assert len(planned) == 12  # the chat ran in every step: its prefill and first token, then 11 decodes
    for total, chat, bulk_entries in planned:
        assert cost.predict(total) <= 1.5 * cost.predict(chat) + 1e-12  # the default interactive_slowdown
        assert bulk_entries > 0  # bulk shared every step, within the target
    assert engine.stats().bulk_rows_deferred > 0  # it had more than fitted
    engine.step()
    total, chat, bulk_entries = planned[-1]
    assert chat == Work() and bulk_entries > 0
    # interactive traffic is about: a bulk step stays short enough for the next urgent request
    assert cost.predict(total) <= cost.fixed / engine.config.bulk_step_overhead + 1e-12


def test_bulk_work_never_waits_out_the_interactive_window(tiny_model):
    """A fit whose fixed part came out zero once sized every bulk step after a chat to nothing: bulk waited
    the whole window (30 s) while the loop planned empty steps. Each step carries work whatever the limit."""
    engine = make_engine(tiny_model, max_num_seqs=16)
    engine.scheduler.cost = FakeCost(fixed=0.0, per_row=0.0)
    engine.add_request(Request("chat", prompts(1, 40, 40, seed=9)[0], greedy(4), priority=9, interactive=True))
    run_until(engine, "chat")
    for i, ids in enumerate(prompts(8, 100, 200)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(16), priority=1))
    for _ in range(2000):  # 8 prompts of at most 200 tokens: a block or a row a step needs about 230
        engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "bulk work made no progress within 2,000 steps"


def test_the_cheapest_recent_step_bounds_a_window_step_from_below():
    cost = StepCost()
    assert cost.cheapest == pytest.approx(cost.predict(Work()))  # before any step: the prior's fixed part
    for seconds in (0.010, 0.003, 0.020):
        cost.observe(Work(decode_rows=4, decode_longest=100), seconds)
    assert cost.cheapest == 0.003


def test_an_absolute_per_token_target_replaces_the_slowdown(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=64, interactive_tpot_ms=12)
    cost = engine.scheduler.cost = FakeCost()
    for i, ids in enumerate(prompts(40, 150, 300)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(40), priority=1))
    for _ in range(4):
        engine.step()
    engine.add_request(Request("chat", prompts(1, 40, 40, seed=9)[0], greedy(6), priority=9, interactive=True))
    engine.step()  # its prefill
    planned = record_plans(engine)
    run_until(engine, "chat")
    for total, chat, _ in planned:  # decodes only: filled up to the target, not to 1.5x what the chat takes
        assert chat.decode_rows == 1 and 1.5 * cost.predict(chat) < 0.011 < cost.predict(total) <= 0.012


def test_an_urgent_request_takes_a_slot_from_bulk_but_never_the_reverse(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    engine.scheduler.cost = FakeCost()  # whether a chunk fits the step's time limit must not hang on this machine
    for i, ids in enumerate(prompts(2, 40, 60)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(30), priority=1))
    engine.step()
    engine.add_request(Request("urgent", prompts(1, 30, 30, seed=9)[0], greedy(20), priority=9, interactive=True))
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert "urgent" in running and len(running) == 2 and engine.stats().preemptions == 1
    # a bulk request of higher priority may displace bulk, not the interactive sequence
    engine.add_request(Request("bulk-high", prompts(1, 30, 30, seed=8)[0], greedy(5), priority=6))
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {"urgent", "bulk-high"} and engine.stats().preemptions == 2


def test_no_bulk_sequence_is_preempted_for_a_newcomer_the_step_has_no_time_for(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    # an interactive decode leaves the step time for fewer prompt tokens than a block holds
    engine.scheduler.cost = FakeCost(per_token=2e-4)
    engine.add_request(Request("bulk", prompts(1, 40, 40)[0], greedy(30), priority=1))
    engine.add_request(Request("urgent", prompts(1, 30, 30, seed=9)[0], greedy(20), priority=9, interactive=True))
    engine.step()
    engine.add_request(Request("bulk-high", prompts(1, 30, 30, seed=8)[0], greedy(5), priority=6))
    for _ in range(3):
        engine.step()
        assert {s.request_id for s in engine.scheduler.running} == {"urgent", "bulk"}
    assert engine.stats().preemptions == 0


def test_a_bulk_sequence_is_not_preempted_again_and_again(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=1, max_preemptions=2)
    engine.add_request(Request("bulk", prompts(1, 50, 50)[0], greedy(30), priority=1))
    engine.step()
    for k in range(2):
        engine.add_request(Request(f"chat{k}", prompts(1, 20, 20, seed=k)[0], greedy(2), priority=9, interactive=True))
        assert run_until(engine, f"chat{k}") == [f"chat{k}"]  # it took the only slot from bulk at once
        engine.step()  # bulk back in
    engine.add_request(Request("chat2", prompts(1, 20, 20, seed=2)[0], greedy(2), priority=9, interactive=True))
    finished = run_until(engine, "chat2")
    assert finished == ["bulk", "chat2"]  # pre-empted twice already: the third chat waited for it
    stats = engine.stats()
    assert stats.preemptions == 2 and stats.preemptions_spared > 0


def test_the_step_cost_fit_keeps_its_weights_non_negative_without_skewing_the_others():
    """On a machine where the steps that read more context happen to be no slower (few long rows batch well), a
    free least-squares fit puts a weight below zero. Clamping that weight after the fit left the others fitted
    to cancel it, and the long-context bulk steps were predicted half as slow again as they were."""
    steps = {Work(decode_rows=30, decode_longest=1000): 0.021, Work(decode_rows=30, decode_longest=200): 0.030,
             Work(decode_rows=1, decode_longest=50): 0.004, Work(decode_rows=10, decode_longest=1000): 0.009}
    cost = StepCost()
    for _ in range(50):
        for work, seconds in steps.items():
            cost.observe(work, seconds)
    assert min(cost.coefficients.values()) >= 0
    for work, seconds in steps.items():
        assert 0.75 < cost.predict(work) / seconds < 1.25, work
