"""The layers every family is built from, over packed batches (`[num_tokens, ...]`, no padding).

Projections that read the same input are fused (q/k/v, gate/up) so each layer is a handful of matrix
multiplies; the loader fills the fused weights shard by shard from the checkpoint's separate tensors. An FP8
checkpoint's projections keep their fp8 weights and block scales (engine.model.fp8). Under
tensor parallelism (engine.model.parallel) a rank's modules hold its slices; attention and MLP each end in an
all-reduce, the embedding too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.fp8 import Fp8Linear
from engine.model.parallel import Split, all_reduce
from engine.model.shape import ModelShape
from kernels.dispatch import Ops


class Rope(NamedTuple):
    """Rotate-half RoPE for one step: float32 `[max_positions, head_dim // 2]` tables and each token's position."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


class QKV(NamedTuple):
    """What a layer's attention takes: `[tokens, heads, head_dim]` q, k, v, and the residual stream it skips."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    residual: torch.Tensor


class Linear(nn.Module):
    """`x @ W.T (+ b)`. Parameters start empty: the checkpoint fills them, so none is initialised.
    `weight` shares an existing parameter instead (tied embeddings)."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter | None = None,
                 bias: bool = False) -> None:
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input stacked into one matrix; `load_shard` fills one of them."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def load_shard(self, index: int, tensor: torch.Tensor, leaf: str = "weight") -> None:
        """`leaf`: "weight" or "bias", whichever of the projection's tensors `tensor` is."""
        start = sum(self.shard_sizes[:index])
        getattr(self, leaf).data[start:start + self.shard_sizes[index]].copy_(tensor)

    def swiglu(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The MLP's `silu(x @ gate.T) * (x @ up.T)`, this being the gate and up projections stacked."""
        return ops.swiglu(x, self.weight)


def projection(in_features: int, shard_sizes: list[int], shape: ModelShape, ops: Ops,
               bias: bool = False) -> Linear | Fp8Linear:
    """One projection, or several of one input fused: fp8 with block scales when the checkpoint's are, else in
    the model's dtype."""
    if shape.fp8:
        return Fp8Linear(in_features, shard_sizes, ops, bias)
    if len(shard_sizes) > 1:
        return MergedLinear(in_features, shard_sizes, bias)
    return Linear(in_features, shard_sizes[0], bias=bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`; without a residual, `x` itself is the next residual."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.ops, self.split = ops, split
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size, self.kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.scale = shape.head_dim ** -0.5
        self.eps = shape.rms_norm_eps  # of q_norm and k_norm, which run fused with RoPE
        self.qkv_proj = projection(shape.hidden_size, [self.q_size, self.kv_size, self.kv_size], shape, ops,
                                   shape.qkv_bias)
        self.o_proj = projection(self.q_size, [shape.hidden_size], shape, ops)
        # Qwen3: a per-head RMSNorm of q and k over head_dim, after the projection and before RoPE
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops) if shape.qk_norm else None

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[tokens, heads, head_dim]` queries, keys and values, q and k (normed and) rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_weight = self.q_norm.weight if self.q_norm is not None else None
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        q, k = self.ops.qk_norm_rope(q.view(-1, self.num_heads, self.head_dim),
                                     k.view(-1, self.num_kv_heads, self.head_dim),
                                     q_weight, k_weight, rope.cos, rope.sin, rope.positions, self.eps)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.ops, self.split = ops, split
        self.gate_up_proj = projection(shape.hidden_size, [shape.intermediate_size] * 2, shape, ops)
        self.down_proj = projection(shape.intermediate_size, [shape.hidden_size], shape, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.down_proj(self.gate_up_proj.swiglu(x, self.ops)), self.split)


class Embedding(nn.Module):
    """The rows of the vocabulary this rank holds (all of them without parallelism); a token's vector comes
    from the rank holding its row, the others add zeros."""

    def __init__(self, num: int, dim: int, split: Split) -> None:
        super().__init__()
        self.split = split
        rows = num // split.world
        self.start = split.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split.parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * held[:, None].to(self.weight.dtype)
        return all_reduce(x, self.split)


