"""A mixture-of-experts layer's experts: the grouped Triton kernels (Triton's interpreter, fp32) and the fast
CPU version against the per-expert reference, the padded layout that groups the pairs by expert, and neither
grouped version reading an expert no token chose; FP8 experts likewise, W8A8 against `fp8_fused_moe_ref` and
dequantized against the reference on their values.

The interpreter multiplies fp8 tiles, but its float32 -> e4m3 casts round some values just below a power of two
down to half of it (tests/test_kernels_fp8_gemm.py), so the W8A8 path is run here with the activations quantized
by `quantize_groups_ref`: the Triton quantizer is tested on its own there, and its rounding on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_gemm, fused_moe, scaled_dot, swiglu, torch_ops
from kernels.fused_moe_ref import dequantize_experts, fp8_fused_moe_ref, fused_moe_ref, quantize_experts
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(fused_moe, swiglu, scaled_dot)

# (tokens, experts, top_k, hidden, intermediate): a decode step over many experts, a prefill whose runs span
# several row tiles, shapes past one column tile (the interpreter's are 64 wide), top-1 and a wide top-k
CASES = [(1, 8, 2, 32, 24), (37, 8, 2, 96, 80), (70, 6, 3, 48, 40), (5, 16, 4, 32, 16), (120, 4, 1, 64, 72)]


def inputs(tokens: int, experts: int, top_k: int, hidden: int, intermediate: int,
           chosen: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Random weights and a softmax top-k routing over `chosen` experts (all of them by default)."""
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, intermediate, generator=gen) / intermediate ** 0.5
    chosen = list(range(experts)) if chosen is None else chosen
    logits = torch.full((tokens, experts), float("-inf"))
    logits[:, chosen] = torch.randn(tokens, len(chosen), generator=gen)
    weights, ids = logits.softmax(-1).topk(top_k)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}tok-{c[1]}e-top{c[2]}" for c in CASES])
@pytest.mark.parametrize("version", ["triton", "torch"])
def test_matches_reference(case, version):
    run = fused_moe.fused_moe if version == "triton" else torch_ops.fused_moe
    args = inputs(*case)
    assert_close(run(*args), fused_moe_ref(*args))


@pytest.mark.parametrize("version", ["triton", "torch"])
def test_an_expert_no_token_chose_is_never_read(version):
    """A step costs the experts its tokens chose: weights of the others, NaN here, never reach the output."""
    run = fused_moe.fused_moe if version == "triton" else torch_ops.fused_moe
    x, w_gate_up, w_down, weights, ids = inputs(40, 8, 2, 32, 24, chosen=[1, 2, 6])
    expected = fused_moe_ref(x, w_gate_up, w_down, weights, ids)
    for idle in (0, 3, 4, 5, 7):
        w_gate_up[idle], w_down[idle] = float("nan"), float("nan")
    assert_close(run(x, w_gate_up, w_down, weights, ids), expected)


def test_pairs_are_grouped_by_expert_in_padded_tiles():
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [0, 3], [3, 0]])
    sorted_pairs, tile_experts = fused_moe.route(ids, num_experts=5, tile_rows=4)
    pairs = ids.numel()
    tiles = sorted_pairs.view(-1, 4)
    # expert 0's four pairs fill a tile, expert 1's one pair pads one, expert 3's five take two; the tiles left
    # of the room for the worst case (every chosen expert one pair past a whole tile) belong to no expert (5)
    assert tile_experts.tolist() == [0, 1, 3, 3, 5, 5, 5]
    for tile, expert in zip(tiles, tile_experts.tolist(), strict=True):
        real = tile[tile < pairs]
        assert (ids.flatten()[real.long()] == expert).all()
        assert expert < 5 or len(real) == 0
    assert sorted(sorted_pairs[sorted_pairs < pairs].tolist()) == list(range(pairs))  # each pair once


# (tokens, experts, top_k, hidden, intermediate) in 128-blocks: a decode step in whole blocks; an expert width of
# 1.5 blocks (the up projection starts its scale rows mid-block, down's K ends in a partial step); a prefill of
# three top-3 experts of width 2.5 blocks over a hidden size of 3
FP8_CASES = [(1, 4, 2, 256, 128), (37, 4, 2, 256, 192), (30, 6, 3, 384, 320)]
FP8_IDS = [f"{c[0]}tok-{c[1]}e-top{c[2]}-{c[3]}x{c[4]}" for c in FP8_CASES]


def fp8_inputs(*case: int, chosen: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """`inputs` with the experts quantized: (x, w_gate_up, gate_up_scales, w_down, down_scales, weights, ids)."""
    x, w_gate_up, w_down, weights, ids = inputs(*case, chosen=chosen)
    return x, *quantize_experts(w_gate_up, w_down), weights, ids


@pytest.fixture
def exact_quantizer(monkeypatch):
    monkeypatch.setattr(fused_moe, "quantize_groups", fp8_gemm.quantize_groups_ref)


@pytest.mark.usefixtures("poisoned_allocations", "exact_quantizer")
@pytest.mark.parametrize("case", FP8_CASES, ids=FP8_IDS)
def test_fp8_experts_w8a8_match_reference(case):
    """To a few 1e-4: the kernel sums each SwiGLU row in another order than the reference before quantizing it
    again, and a value on a rounding edge lands one fp8 step away (a whole token's output moves by its share).
    Leaving the activations unquantized would be off by a few percent (below)."""
    args = fp8_inputs(*case)
    assert_close(fused_moe.fp8_fused_moe(*args), fp8_fused_moe_ref(*args), rel=2e-3)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("case", FP8_CASES, ids=FP8_IDS)
@pytest.mark.parametrize("version", ["triton", "torch"])
def test_dequantized_fp8_experts_compute_their_values(case, version):
    """Elsewhere than on FP8 tensor cores the experts' fp8 weights are expanded for each matmul: the result is
    the reference's on their dequantized values, the activations unquantized."""
    run = fused_moe.dequant_fused_moe if version == "triton" else torch_ops.fp8_fused_moe
    x, *experts, weights, ids = fp8_inputs(*case)
    assert_close(run(x, *experts, weights, ids), fused_moe_ref(x, *dequantize_experts(*experts), weights, ids))


def test_w8a8_rounds_the_activations_too():
    """The two FP8 paths differ by the activations' rounding to fp8, which only W8A8 does: a few percent here."""
    x, *experts, weights, ids = fp8_inputs(*FP8_CASES[1])
    values = fused_moe_ref(x, *dequantize_experts(*experts), weights, ids)
    error = (fp8_fused_moe_ref(x, *experts, weights, ids) - values).abs().max() / values.abs().max()
    assert 1e-3 < error < 0.1


@pytest.mark.usefixtures("exact_quantizer")
@pytest.mark.parametrize("version", ["w8a8", "dequant", "torch"])
def test_an_fp8_expert_no_token_chose_is_never_read(version):
    run = {"w8a8": fused_moe.fp8_fused_moe, "dequant": fused_moe.dequant_fused_moe,
           "torch": torch_ops.fp8_fused_moe}[version]
    x, w_gate_up, gate_up_scales, w_down, down_scales, weights, ids = fp8_inputs(24, 6, 2, 256, 192, chosen=[1, 4])
    expected = run(x, w_gate_up, gate_up_scales, w_down, down_scales, weights, ids)
    for idle in (0, 2, 3, 5):
        gate_up_scales[idle], down_scales[idle] = float("nan"), float("nan")
    assert torch.equal(run(x, w_gate_up, gate_up_scales, w_down, down_scales, weights, ids), expected)
