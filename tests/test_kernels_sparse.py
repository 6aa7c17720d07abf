"""Block-sparse policies: the CSR of each policy must be exactly the tile reduction of its token mask."""

from __future__ import annotations

import pytest
import torch

from kernels.attention_ref import visible
from kernels.sparse import AttentionPolicy, block_csr, block_mask

POLICIES = [
    AttentionPolicy.dense(),
    AttentionPolicy.sliding(7),
    AttentionPolicy.sliding(1),
    AttentionPolicy.streaming(9, 3),
    AttentionPolicy.streaming(4, 17),
    AttentionPolicy.local_strided(5, 6),
    AttentionPolicy.local_strided(20, 4),
    AttentionPolicy.sliding(1000),
]


def _rows(seq_len: int, new_tokens: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query position ranges of the tiles of the last `new_tokens` positions, plus one empty row."""
    starts = list(range(seq_len - new_tokens, seq_len, block_m))
    first = torch.tensor([*starts, 5])
    last = torch.tensor([min(s + block_m, seq_len) - 1 for s in starts] + [4])
    return first, last


def _expected(policy: AttentionPolicy, first: torch.Tensor, last: torch.Tensor, tiles: int, block_n: int):
    keys = torch.arange(tiles * block_n)
    rows = []
    for lo, hi in zip(first.tolist(), last.tolist(), strict=True):
        seen = visible(torch.arange(lo, hi + 1), keys, policy.window, policy.sinks, policy.stride).any(0)
        rows.append(seen.view(tiles, block_n).any(1))
    return torch.stack(rows)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize(("seq_len", "new_tokens", "block_m", "block_n"), [(70, 50, 8, 4), (37, 37, 16, 16), (90, 1, 1, 8)])
def test_csr_matches_token_mask(policy, seq_len, new_tokens, block_m, block_n):
    first, last = _rows(seq_len, new_tokens, block_m)
    tiles = -(-seq_len // block_n) + 1  # one tile past the sequence: nothing may select it
    expected = _expected(policy, first, last, tiles, block_n)
    assert torch.equal(block_mask(policy, first, last, tiles, block_n), expected)

    csr = block_csr(policy, first, last, tiles, block_n)
    dense = torch.zeros_like(expected)
    for row in range(len(first)):
        cols = csr.col_idx[csr.row_ptr[row]:csr.row_ptr[row + 1]]
        assert torch.all(cols[1:] > cols[:-1]), "each row's tiles ascend"
        dense[row, cols.long()] = True
    assert torch.equal(dense, expected)
    assert csr.max_row == int(expected.sum(1).max())


def test_window_covering_the_sequence_is_dense():
    first, last = _rows(100, 100, 16)
    dense = block_csr(AttentionPolicy.dense(), first, last, 8, 16)
    wide = block_csr(AttentionPolicy.streaming(100, 3), first, last, 8, 16)
    assert torch.equal(dense.row_ptr, wide.row_ptr) and torch.equal(dense.col_idx, wide.col_idx)


def test_work_scales_with_the_window():
    """A 1k window over 32k tokens keeps about (window + query tile) / key tile tiles per row, not 256."""
    first, last = _rows(32768, 32768, 128)
    csr = block_csr(AttentionPolicy.sliding(1024), first, last, 512, 64)
    assert csr.max_row <= (1024 + 128) // 64 + 1
    assert csr.col_idx.numel() < 0.08 * block_mask(AttentionPolicy.dense(), first, last, 512, 64).sum()


@pytest.mark.parametrize("fields", [dict(window=-1), dict(sinks=4), dict(window=8, stride=-2)])
def test_invalid_policies(fields):
    with pytest.raises(ValueError):
        AttentionPolicy(**fields)
