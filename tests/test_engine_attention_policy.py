"""`EngineConfig.attention_policy`: parsing, a window covering every sequence equals dense attention, and a
plain sliding window recycles its blocks."""

from __future__ import annotations

import pytest

from engine.attention_policy import parse_policy
from engine.interface import Request
from kernels.sparse import AttentionPolicy
from tests.engine_helpers import greedy, make_engine, prompts, run_all

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = prompts(6, 40, 300, seed=4)


def generate(path, policy: str, check=None) -> list[list[int]]:
    engine = make_engine(path, attention_policy=policy, prefill_chunk_size=128)
    done = run_all(engine, [Request(str(i), ids, greedy(12)) for i, ids in enumerate(PROMPTS)], check)
    return [done[str(i)].token_ids for i in range(len(PROMPTS))]


def test_parse_policy():
    assert parse_policy("dense") == AttentionPolicy.dense()
    assert parse_policy("sliding:128") == AttentionPolicy.sliding(128)
    assert parse_policy("streaming:128:4") == AttentionPolicy.streaming(128, 4)
    assert parse_policy("strided:64:16") == AttentionPolicy.local_strided(64, 16)
    for bad in ("sparse", "sliding", "sliding:0", "sliding:x", "streaming:8", "strided:8:4:2", "dense:4"):
        with pytest.raises(ValueError, match="attention_policy"):
            parse_policy(bad)


@pytest.mark.parametrize("policy", ["sliding:1024", "streaming:1000:4", "strided:1000:7"])
def test_window_covering_every_sequence_equals_dense(tiny_model, policy):
    assert generate(tiny_model, policy) == generate(tiny_model, "dense")


def test_sliding_policy_recycles_blocks(tiny_model):
    window, block = 32, 16
    # a ring holds the window behind the step's oldest query plus the step's chunk, rounded out to blocks
    ring = -(-(window - 1 + 128) // block) + 1

    def bounded(engine):
        assert engine.stats().kv_window_blocks_used <= ring * len(PROMPTS)

    sliding = generate(tiny_model, f"sliding:{window}", bounded)
    assert sliding != generate(tiny_model, "dense")
    assert generate(tiny_model, f"streaming:{window}:4") != sliding
