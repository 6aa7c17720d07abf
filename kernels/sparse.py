"""Block-sparse attention patterns: a policy says which keys a query sees, and `block_csr` turns it into the
list of key tiles each query tile must visit, stored as CSR (row pointers + column indices).

The attention kernels walk only the tiles the CSR lists and still apply the exact token mask inside each
tile (`attention_ref.visible`), so the CSR only has to be a superset of the tiles with a visible key; here it
is exact: a tile is listed iff at least one of its keys is visible to at least one query of the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionPolicy:
    """The pattern as the attention kernels take it: `window` 0 means dense causal; otherwise keys within
    `window` of the query, plus the first `sinks` keys, plus every `stride`-th key."""

    window: int = 0
    sinks: int = 0
    stride: int = 0

    @classmethod
    def dense(cls) -> AttentionPolicy:
        return cls()

    @classmethod
    def sliding(cls, window: int) -> AttentionPolicy:
        return cls(window=window)

    @classmethod
    def streaming(cls, window: int, sinks: int) -> AttentionPolicy:
        """StreamingLLM: a sliding window plus attention sinks at the start of the sequence."""
        return cls(window=window, sinks=sinks)

    @classmethod
    def local_strided(cls, local: int, stride: int) -> AttentionPolicy:
        return cls(window=local, stride=stride)

    def __post_init__(self) -> None:
        if min(self.window, self.sinks, self.stride) < 0:
            raise ValueError(f"negative attention policy field: {self}")
        if self.window == 0 and (self.sinks or self.stride):
            raise ValueError("sinks and stride only apply with a window (window 0 is dense causal)")


@dataclass(frozen=True)
class BlockCSR:
    """Row `r` visits key tiles `col_idx[row_ptr[r]:row_ptr[r + 1]]`, ascending; `max_row` is the longest row."""

    row_ptr: torch.Tensor  # [rows + 1] int32
    col_idx: torch.Tensor  # [nnz] int32
    max_row: int


def block_mask(
    policy: AttentionPolicy, q_first: torch.Tensor, q_last: torch.Tensor, num_key_tiles: int, block_n: int
) -> torch.Tensor:
    """`[rows, num_key_tiles]` bool: whether a tile of `block_n` keys holds a key visible to some query at
    positions `q_first[r]..q_last[r]` (a row with `q_last < q_first` has no queries and keeps nothing)."""
    first, last = q_first.long().unsqueeze(1), q_last.long().unsqueeze(1)
    k0 = torch.arange(num_key_tiles, device=q_first.device).unsqueeze(0) * block_n
    k1 = k0 + block_n - 1
    keep = (k0 <= last) & (first <= last)
    if policy.window == 0:
        return keep
    # The query closest to a key is the latest one not after it, so the tile's last key decides the window.
    near = k1 > first - policy.window
    sink = k0 < policy.sinks
    if policy.stride > 0:
        strided_key = k0 + (policy.stride - 1 - k0) % policy.stride  # first strided key at or after k0
        near |= strided_key <= torch.minimum(k1, last)
    return keep & (near | sink)


def block_csr(
    policy: AttentionPolicy, q_first: torch.Tensor, q_last: torch.Tensor, num_key_tiles: int, block_n: int
) -> BlockCSR:
    mask = block_mask(policy, q_first, q_last, num_key_tiles, block_n)
    counts = mask.sum(1, dtype=torch.int32)
    row_ptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    col_idx = mask.nonzero()[:, 1].to(torch.int32)  # nonzero is row-major, so each row's tiles ascend
    max_row = int(counts.max()) if counts.numel() else 0
    return BlockCSR(row_ptr, col_idx, max_row)
