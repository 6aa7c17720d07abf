"""A mixture-of-experts layer's experts: the grouped Triton kernels (Triton's interpreter, fp32) and the fast
CPU version against the per-expert reference, the padded layout that groups the pairs by expert, and neither
grouped version reading an expert no token chose."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe, torch_ops
from kernels.fused_moe_ref import fused_moe_ref
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(fused_moe)

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
