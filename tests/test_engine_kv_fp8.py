"""An fp8 KV cache (`kv_cache_dtype="fp8"`) end to end on CPU: half the KV bytes, logits close to a full one."""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import kv_cache_dtype
from engine.interface import Request
from engine.llm_engine import LLMEngine
from tests.engine_helpers import greedy, make_engine, prompts, run_all

pytestmark = pytest.mark.usefixtures("single_thread")


def prefill_logits(engine: LLMEngine) -> torch.Tensor:
    """Logits at every position of a few prompts prefilled together in one step: each token's attention reads
    its sequence's K/V back from the cache, so every row sees the cache's precision."""
    for i, ids in enumerate(prompts(4, 150, 200, seed=7)):
        engine.add_request(Request(str(i), ids, greedy(1)))
    step = engine.executor.pack(engine.scheduler.schedule(time.monotonic()))
    with torch.inference_mode():
        return engine.model.compute_logits(engine.executor.forward(step))


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_fp8_logits_close_to_fp32(tiny_models, preset):
    full = prefill_logits(make_engine(tiny_models[preset]))
    fp8 = prefill_logits(make_engine(tiny_models[preset], kv_cache_dtype="fp8"))
    # e4m3 keeps 3 mantissa bits, so each K/V value is off by up to ~6%; these random tiny models have flat
    # logits, where that flips the top token now and then
    assert (full.argmax(-1) == fp8.argmax(-1)).float().mean() > 0.75
    assert (full - fp8).abs().max() < 0.2 * full.abs().max()


def test_fp8_generates_end_to_end(tiny_model):
    engine = make_engine(tiny_model, kv_cache_dtype="fp8", prefill_chunk_size=64, max_num_batched_tokens=256)
    requests = [Request(str(i), ids, greedy(8)) for i, ids in enumerate(prompts(6, 5, 150, seed=2))]
    done = run_all(engine, requests)
    assert all(len(done[r.request_id].token_ids) == 8 for r in requests)
    assert engine.stats().kv_blocks_used == 0


def test_fp8_halves_kv_bytes_of_bf16(tiny_models):
    for path in tiny_models.values():
        bf16 = make_engine(path, dtype="bfloat16", kv_cache_memory=2**24)
        fp8 = make_engine(path, dtype="bfloat16", kv_cache_memory=2**24, kv_cache_dtype="fp8")
        bf16_report, fp8_report = bf16.memory_report(), fp8.memory_report()
        assert fp8_report["kv_bytes_per_token"] * 2 == bf16_report["kv_bytes_per_token"]
        # the same budget holds twice the blocks (what a pool reaches of it depends on its growth steps)
        assert sum(fp8.kv_plan.max_blocks) == pytest.approx(2 * sum(bf16.kv_plan.max_blocks), rel=0.01)
        assert fp8.blocks.pools[0].cache.bytes_per_block * 2 == bf16.blocks.pools[0].cache.bytes_per_block


def test_unknown_kv_cache_dtype_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(tiny_model, kv_cache_dtype="int4")


def test_kv_cache_dtype_option():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
