"""The engine on the Triton kernels (Triton's interpreter on CPU, fp32): greedy output equals the torch path's,
for a dense model, a sliding-window one and a mixture of experts."""

from __future__ import annotations

import pytest

from engine.interface import Request
from kernels import attention, fused_moe, kv_store, qk_norm_rope, rms_norm, scaled_dot, swiglu
from tests.engine_helpers import greedy, make_engine, prompts, run_all
from tests.test_kernels_support import interpret_kernels

pytestmark = pytest.mark.usefixtures("single_thread")

interpreted_kernels = interpret_kernels(attention, kv_store, qk_norm_rope, rms_norm, swiglu, scaled_dot, fused_moe)

# prompts longer than the windows (tiny-swa's 64, the policy's 32) and than one block, in two prefill chunks
PROMPTS = prompts(2, 50, 90, seed=5)
# where windows play no part (the experts' kernels see every token alike): one prefill chunk each
SHORT_PROMPTS = prompts(2, 20, 40, seed=5)
NEW_TOKENS = 4


def generate(path, backend: str, requests: list[list[int]] = PROMPTS, **settings) -> list[list[int]]:
    engine = make_engine(path, attention_backend=backend, prefill_chunk_size=48, max_num_batched_tokens=64,
                         max_num_seqs=8, **settings)
    assert engine.executor.ops.backend == backend
    done = run_all(engine, [Request(str(i), ids, greedy(NEW_TOKENS)) for i, ids in enumerate(requests)])
    return [done[str(i)].token_ids for i in range(len(requests))]


# An fp8 cache is left out: the interpreter rounds fp32 -> e4m3 casts just below a power of two down to half
# of it, so its K/V differ from the reference's. The kernel tests read fp8 caches with exactly representable
# values, and bench/gpu_kernels.py checks the rounding on a GPU.
@pytest.mark.parametrize(("preset", "settings"), [
    ("tiny", {}),
    # the model's sliding-window layers, and attention sinks on its full-attention layers
    ("tiny-swa", {"attention_policy": "streaming:32:4"}),
    ("tiny-moe", {"requests": SHORT_PROMPTS}),  # the experts' grouped kernels beside the dense MLP's
], ids=["dense", "sliding-window-model-streaming", "mixture-of-experts"])
def test_triton_greedy_matches_torch(tiny_models, preset, settings):
    path = tiny_models[preset]
    assert generate(path, "triton", **settings) == generate(path, "torch", **settings)


def test_windowed_tile_layouts_are_worked_out_once_per_step_not_per_layer(tiny_models, monkeypatch):
    engine = make_engine(tiny_models["tiny-swa"], attention_backend="triton", attention_policy="streaming:32:4",
                         prefill_chunk_size=48, max_num_batched_tokens=64, max_num_seqs=8)
    built = []
    block_csr = attention.block_csr
    monkeypatch.setattr(attention, "block_csr", lambda *args: built.append(args[0]) or block_csr(*args))
    engine.add_request(Request("r", PROMPTS[0], greedy(NEW_TOKENS)))
    engine.step()  # one prefill chunk: one part
    windowed = [s for s in engine.kv_plan.layer_slots if s.policy.window]
    groups = {(s.pool, s.policy) for s in windowed}
    assert len(built) == len(groups) < len(windowed)


def test_fp8_experts_on_triton_match_torch(fp8_moe_models):
    """FP8 experts where there are no FP8 tensor cores: the Triton kernels expand each tile's fp8 weights in
    registers, the CPU path each chosen expert's; experts of 1.5 blocks, whose up projections start mid-block."""
    path, _ = fp8_moe_models["ragged"]
    assert generate(path, "triton", SHORT_PROMPTS) == generate(path, "torch", SHORT_PROMPTS)
