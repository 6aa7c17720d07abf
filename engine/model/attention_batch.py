"""A step's attention batch: what its attention layers need to reach the paged KV cache, and the calls that attend.

Kernels follow the layout of `kernels.attention_ref` (its docstring is the contract). A step's sequences are
laid out decodes first, then prefill chunks; each run goes to the backend in its own call, so decodes take the
backend's batched single-query path instead of the general one. On CPU the plain-PyTorch ops of
`kernels.torch_ops` stand in for the references (except attention over fp8 caches, which only the references
dequantize), and decodes may read `DenseDecodeKV` rows; where they do, rows verifying drafts join the decodes'
run (a pool without dense rows attends to that run's single tokens in one batched call, its others row by
row). Each layer attends with its own `AttentionPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.core.kv_cache import KVCache
from engine.model.dense_decode import DenseDecodeKV
from kernels.dispatch import Ops
from kernels.sparse import AttentionPolicy


class LayerSlot(NamedTuple):
    """Where one model layer keeps its K/V, and the pattern it attends with."""

    pool: int
    index: int  # of the layer in its pool's cache
    policy: AttentionPolicy


@dataclass
class BatchPart:
    """Consecutive sequences of a step attended to in one kernel call: all decodes, or all prefill chunks."""

    start: int  # first token of the part in the packed batch
    end: int
    cu_seqlens_q: torch.Tensor  # relative to `start`
    seq_lens: torch.Tensor
    block_tables: list[torch.Tensor]  # one per KV pool
    dense: DenseDecodeKV | None = None  # decodes whose full-attention layers read dense rows instead
    # the Triton kernels' tile layouts of this part, worked out by its first layer and kept for the others
    layouts: dict = field(default_factory=dict)


@dataclass
class AttentionBatch:
    ops: Ops
    caches: list[KVCache]  # one per KV pool
    layer_slots: list[LayerSlot]  # per model layer
    slot_mapping: list[torch.Tensor]  # per pool: where each new token's K/V goes
    parts: list[BatchPart]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        pool, index, policy = self.layer_slots[layer]
        cache = self.caches[pool]
        k_cache, v_cache = cache.layer(index)
        k_scale, v_scale = cache.layer_scales(index, k, v)
        # only fp8 caches pass scales: the fast CPU ops take none (select_ops gives fp8 the references)
        scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        triton = self.ops.backend == "triton"
        self.ops.store_kv(k, v, k_cache, v_cache, self.slot_mapping[pool], **scales)
        outs = []
        for part in self.parts:
            rows = slice(part.start, part.end)
            if part.dense is not None and part.dense.pool == pool:
                outs.append(part.dense.attend(index, q[rows], k[rows], v[rows], scale))
            else:
                kept = {"layouts": part.layouts} if triton else {}
                outs.append(self.ops.paged_attention(q[rows], k_cache, v_cache, part.cu_seqlens_q, part.seq_lens,
                                                     part.block_tables[pool], scale, policy.window, policy.sinks,
                                                     policy.stride, **scales, **kept))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
