"""Scheduling and KV memory: admission within the budget, pool growth, priorities, ageing, the ring."""

from __future__ import annotations

import itertools
import math
import time

from engine.block_manager import GROWTH
from engine.interface import Request
from tests.engine_helpers import greedy, kv_block_bytes, make_engine, prompts, run_all, single_thread  # noqa: F401 (single_thread: autouse)


def test_pool_too_small_for_everything_at_once(tiny_model):
    budget_blocks = 40
    engine = make_engine(tiny_model, kv_cache_memory=budget_blocks * kv_block_bytes(tiny_model), initial_blocks=4)
    pool = engine.blocks.pools[0]
    capacities = [pool.capacity]

    def check(engine) -> None:
        stats = engine.stats()
        assert stats["kv_blocks_used"] <= stats["kv_blocks_total"] <= budget_blocks
        assert engine.memory_report()["pool_bytes"] <= engine.plan.budget_bytes
        if pool.capacity != capacities[-1]:
            capacities.append(pool.capacity)

    # 16 requests of up to 17 blocks each: a few fit at a time
    requests = [Request(str(i), ids, greedy(24)) for i, ids in enumerate(prompts(16, 100, 250))]
    done = run_all(engine, requests, check)
    assert sorted(done) == sorted(r.request_id for r in requests)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in done.values())
    assert engine.stats()["kv_blocks_used"] == 0
    # grew geometrically from the initial size, and stopped at the budget
    assert capacities[-1] == budget_blocks
    for small, big in itertools.pairwise(capacities[:-1]):  # the last step is cut to the budget
        assert big == math.ceil(small * GROWTH)


def test_priority_request_preempts_and_finishes_first(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=32)
    for i, ids in enumerate(prompts(32, 20, 60)):
        engine.add_request(Request(f"bulk{i}", ids, greedy(40), priority=1))
    for _ in range(3):
        assert engine.step() == []
    assert engine.stats()["running"] == 32
    engine.add_request(Request("urgent", prompts(1, 30, 30, seed=9)[0], greedy(8), priority=9))
    order = list(run_all(engine, []))  # in finishing order
    assert order[0] == "urgent" and len(order) == 33
    assert engine.stats()["preemptions"] >= 1  # every slot was taken: a bulk request made room


def test_ageing_lets_old_low_priority_work_go_first(tiny_model):
    def first_admitted(ageing_rate: float) -> str:
        engine = make_engine(tiny_model, max_num_seqs=1, ageing_rate=ageing_rate)
        # waited 100 s at priority 0 against a fresh priority 9
        engine.add_request(Request("old", [5] * 10, greedy(2), priority=0, arrival=time.monotonic() - 100))
        engine.add_request(Request("new", [6] * 10, greedy(2), priority=9))
        engine.step()
        return engine.scheduler.running[0].request_id

    assert first_admitted(ageing_rate=0.0) == "new"
    assert first_admitted(ageing_rate=0.1) == "old"


def test_equal_priority_runs_in_arrival_order_without_preemption(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=2)
    requests = [Request(str(i), ids, greedy(4), priority=3) for i, ids in enumerate(prompts(6, 10, 20))]
    done = run_all(engine, requests)
    assert list(done) == [str(i) for i in range(6)]
    assert engine.stats()["preemptions"] == 0


def test_sliding_window_blocks_stay_bounded(tiny_models):
    path = tiny_models["tiny-swa"]  # layers 2-3 attend to the last 64 tokens
    engine = make_engine(path, block_size=16)
    window_pool = engine.blocks.pools[engine.windows.index(64)]
    seen = {"window": 0, "full": 0}

    def check(engine) -> None:
        stats = engine.stats()
        seen["window"] = max(seen["window"], stats["kv_window_blocks_used"])
        seen["full"] = max(seen["full"], stats["kv_blocks_used"] - stats["kv_window_blocks_used"])

    done = run_all(engine, [Request("long", prompts(1, 20, 20)[0], greedy(600))], check)
    assert len(done["long"].token_ids) == 600
    assert seen["full"] >= 600 // 16  # full attention keeps everything
    assert seen["window"] <= math.ceil(64 / 16) + 1  # the ring: the window plus the block being filled
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
