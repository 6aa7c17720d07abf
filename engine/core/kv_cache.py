"""The K/V tensors of one block pool: `[num_blocks, block_size, num_kv_heads, head_dim]` per layer."""

from __future__ import annotations

import math

import torch

# An fp8 layer's scales map its first K/V's largest magnitude to this fraction of the fp8 range, leaving room
# for later tokens to be larger (anything beyond the range is clamped) while small values stay normal numbers.
FP8_HEADROOM = 4.0
GROWTH = 1.5  # a pool grows at least this much at a time: each growth copies what it holds


class KVCache:
    """K and V for the layers that share one pool (all full-attention layers, or all sliding-window ones).

    Each layer's K and each layer's V is a tensor of its own (a segment), so growing the pool replaces one
    segment at a time: while a segment is copied only that one exists twice, and the pool never holds more
    than its budget (`growth_plan` picks the sizes that guarantee it). Block ids stay valid across a resize.
    `version` changes on every resize, so captured CUDA graphs know they are stale.

    An fp8 cache also holds per-layer, per-KV-head float32 scales (stored value * scale = real value). They
    are fixed by the first K/V a layer stores (a model's first step is always a prefill, so that is prompt
    data) and never change afterwards, so every block of a layer shares one scale and nothing is requantized.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (num_layers, block_size, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.version = 0
        # zeros, not empty: padded and recycled table entries read block 0, and NaN garbage would poison the
        # weighted sum even where the attention weight is exactly zero
        self.segments = [self._zeros(num_blocks) for _ in range(2 * num_layers)]  # K of each layer, then V
        self.scaled = dtype.itemsize == 1  # fp8
        # updated in place, never reallocated, so captured CUDA graphs keep reading the live scales
        self.scales = torch.ones(2, num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.calibrated = [not self.scaled] * num_layers

    def _zeros(self, num_blocks: int) -> torch.Tensor:
        _, block_size, heads, dim = self.shape
        return torch.zeros(num_blocks, block_size, heads, dim, dtype=self.dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.segments[0].shape[0]

    @property
    def bytes_per_block(self) -> int:
        return len(self.segments) * self.segments[0][0].numel() * self.dtype.itemsize

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.segments[index], self.segments[self.shape[0] + index]

    def read_block(self, block: int, out: torch.Tensor) -> None:
        """Copy block `block` of every layer's K and V into `out` `[2 * num_layers, block_size, heads, dim]`."""
        for i, segment in enumerate(self.segments):
            out[i].copy_(segment[block], non_blocking=True)

    def write_block(self, block: int, source: torch.Tensor) -> None:
        """The reverse of `read_block`."""
        for i, segment in enumerate(self.segments):
            segment[block].copy_(source[i], non_blocking=True)

    def block_shape(self) -> tuple[int, ...]:
        return len(self.segments), *self.shape[1:]

    def layer_scales(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """`(k_scale, v_scale)` of layer `index` for storing the new `k`, `v` `[tokens, kv_heads, head_dim]`;
        `(None, None)` unless the cache is fp8. The first call for a layer sets its scales from `k` and `v`."""
        if not self.scaled:
            return None, None
        if not self.calibrated[index]:
            limit = torch.finfo(self.dtype).max / FP8_HEADROOM
            for i, x in enumerate((k, v)):
                amax = x.detach().float().abs().amax(dim=(0, 2))
                # the floor keeps a head whose first values were all zero from clamping everything after to 0
                self.scales[i, index] = amax.clamp(min=1e-6) / limit
            self.calibrated[index] = True
        return self.scales[0, index], self.scales[1, index]

    def resize(self, num_blocks: int) -> None:
        """Grow to `num_blocks`, keeping every block's contents, one segment at a time. Only between steps:
        views taken before are stale."""
        old = self.num_blocks
        for i in range(len(self.segments)):  # by index: an iterator's tuple would keep the old segment alive
            grown = self._zeros(num_blocks)
            grown[:old].copy_(self.segments[i])
            self.segments[i] = grown  # the old segment goes now, before the next is allocated
        self.version += 1


def growth_plan(initial: int, ceiling: int, segments: int) -> list[int]:
    """The sizes (blocks) a pool of `segments` segments takes from `initial` on; the last is the most it may
    hold. While one segment is copied, the pool holds the new segments so far, the old ones not yet replaced
    and the one being filled: at most the new size plus 1/`segments` of the old. So it grows 1.5x while under
    half of `ceiling`, then once to what that peak leaves: `ceiling` less 1/`segments` of the size before
    (under 1% of the budget for a 28-layer pool, a quarter at worst for a pool of one layer)."""
    if initial > ceiling // 2:
        return [ceiling]
    sizes = [initial]
    while (grown := max(sizes[-1] + 1, math.ceil(sizes[-1] * GROWTH))) <= ceiling // 2:
        sizes.append(grown)
    last = ceiling - math.ceil(sizes[-1] / segments)
    return [*sizes, last] if last > sizes[-1] else sizes
