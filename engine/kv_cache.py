"""The K/V tensors of one block pool: `[num_blocks, block_size, num_kv_heads, head_dim]` per layer."""

from __future__ import annotations

import torch

# An fp8 layer's scales map its first K/V's largest magnitude to this fraction of the fp8 range, leaving room
# for later tokens to be larger (anything beyond the range is clamped) while small values stay normal numbers.
FP8_HEADROOM = 4.0


class KVCache:
    """K and V for the layers that share one pool (all full-attention layers, or all sliding-window ones).

    One tensor holds every layer so that growing the pool is one allocation and one copy; block ids stay
    valid across a resize. `version` changes on every resize, so captured CUDA graphs know they are stale.

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
        self.data = self._zeros(num_blocks)
        self.scaled = dtype.itemsize == 1  # fp8
        # updated in place, never reallocated, so captured CUDA graphs keep reading the live scales
        self.scales = torch.ones(2, num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.calibrated = [not self.scaled] * num_layers

    def _zeros(self, num_blocks: int) -> torch.Tensor:
        num_layers, block_size, heads, dim = self.shape
        return torch.zeros(2, num_layers, num_blocks, block_size, heads, dim, dtype=self.dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def bytes_per_block(self) -> int:
        return self.data[:, :, :1].numel() * self.data.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[0, index], self.data[1, index]

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
        """Grow to `num_blocks`, keeping every block's contents. Only between steps: views taken before are stale."""
        grown = self._zeros(num_blocks)
        grown[:, :, : self.num_blocks].copy_(self.data)
        self.data = grown
        self.version += 1
