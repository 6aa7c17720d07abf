"""Which KV pools a model needs, which layer keeps its K/V where, and how many blocks each pool may hold.

One pool per attention kind: full attention (window 0) and each ring-recycled sliding window in use. A
`KVLayout` is the pools before any memory is counted; a `KVPlan` adds each pool's ceiling, which the
memory-fit rule (`engine.model.memory_fit`) works out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from engine.attention_policy import layer_policies, parse_policy, ring_window
from engine.config import EngineConfig
from engine.model.attention_batch import LayerSlot
from engine.model.shape import ModelShape
from kernels.sparse import AttentionPolicy


@dataclass(frozen=True)
class KVLayout:
    policies: list[AttentionPolicy]  # per model layer
    windows: list[int]  # per pool: 0 for full attention, else the ring's window
    layers: list[int]  # per pool: how many model layers keep their K/V there
    layer_slots: list[LayerSlot]  # per model layer: its pool, its index there, its policy
    kv_bytes_per_token: int  # all layers
    block_bytes: list[int]  # per pool
    chunk: int  # the most prompt tokens of one sequence computed in a step

    def blocks_per_seq(self, block_size: int, num_tokens: int) -> list[int]:
        """The most blocks of each pool one sequence of `num_tokens` tokens holds."""
        return blocks_per_seq(self.windows, block_size, num_tokens, self.chunk)

    @property
    def dense_only(self) -> bool:
        """Every layer attends to every key it has (no window, sinks or strides anywhere)."""
        return all(p.window == 0 for p in self.policies)


@dataclass(frozen=True)
class KVPlan(KVLayout):
    budget_bytes: int
    max_blocks: list[int]  # per pool: its ceiling within the budget

    @classmethod
    def within(cls, layout: KVLayout, budget_bytes: int, max_blocks: list[int]) -> KVPlan:
        return cls(**{f.name: getattr(layout, f.name) for f in fields(KVLayout)}, budget_bytes=budget_bytes,
                   max_blocks=max_blocks)


def lay_out_kv(shape: ModelShape, config: EngineConfig, cache_dtype: torch.dtype) -> KVLayout:
    policies = layer_policies(shape.windows, parse_policy(config.attention_policy))
    rings = [ring_window(p) for p in policies]
    windows = sorted(set(rings))
    layers = [rings.count(w) for w in windows]
    layer_slots = [LayerSlot(windows.index(w), rings[:i].count(w), p)
                   for i, (w, p) in enumerate(zip(rings, policies, strict=True))]
    kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * cache_dtype.itemsize
    block_bytes = [n * kv_bytes_per_token // shape.num_layers * config.block_size for n in layers]
    chunk = min(config.prefill_chunk_size, config.max_num_batched_tokens)
    return KVLayout(policies, windows, layers, layer_slots, kv_bytes_per_token, block_bytes, chunk)


def blocks_per_seq(windows: list[int], block_size: int, num_tokens: int, chunk: int) -> list[int]:
    """The most blocks of each pool one sequence of `num_tokens` tokens holds, prefilled `chunk` at a time."""
    full = math.ceil(num_tokens / block_size)
    # a ring holds the window behind the oldest query of a step plus the step's chunk, rounded out to blocks
    return [full if w == 0 else min(full, math.ceil((w - 1 + chunk) / block_size) + 1) for w in windows]
