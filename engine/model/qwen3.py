"""Qwen3 as our own PyTorch modules, over packed batches.

Every forward takes the new tokens of all sequences back to back (`[num_tokens]`, no padding) with their
positions; attention reads and writes the paged KV cache through an `AttentionBatch`. Projections that read
the same input are fused (q/k/v, gate/up) so each layer is a handful of matrix multiplies; the loader fills
the fused weights shard by shard from the checkpoint's separate tensors. The forward is a chain of pieces,
each everything between two attentions, so that CUDA graphs can replay the pieces (engine.model.cuda_graphs).
Under tensor parallelism (engine.model.parallel) a rank's modules hold its slices and its shape (`rank_shape`)
counts its own heads and MLP width; attention and MLP each end in an all-reduce, the embedding too, and the LM
head gathers the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention_batch import AttentionBatch
from engine.model.parallel import ALONE, Split, all_reduce, check_split, gather_columns, kv_heads_per_rank
from kernels.dispatch import Ops
from kernels.qk_norm_rope import Yarn, rope_tables


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a Qwen3 config.json that the modules need."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    windows: tuple[int, ...]  # per layer: 0 for full attention, else the sliding window
    yarn: Yarn | None = None  # YaRN rope scaling; None: the default rotary embedding


def rank_shape(shape: ModelShape, split: Split) -> ModelShape:
    """What one of `split.world` ranks computes: its share of the heads and of the MLP (the vocabulary and the
    hidden size stay whole: the embedding and the LM head split their rows themselves)."""
    if not split.parallel:
        return shape
    check_split(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, split.world)
    return replace(shape, num_heads=shape.num_heads // split.world,
                   num_kv_heads=kv_heads_per_rank(shape.num_kv_heads, split.world),
                   intermediate_size=shape.intermediate_size // split.world)


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
    """`x @ W.T` without bias. Parameters start empty: the checkpoint fills them, so none is initialised.
    `weight` shares an existing parameter instead (tied embeddings)."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedLinear(Linear):
    """Several projections of one input stacked into one matrix; `load_shard` fills one of them."""

    def __init__(self, in_features: int, shard_sizes: list[int]) -> None:
        super().__init__(in_features, sum(shard_sizes))
        self.shard_sizes = shard_sizes

    def load_shard(self, index: int, weight: torch.Tensor) -> None:
        start = sum(self.shard_sizes[:index])
        self.weight.data[start:start + self.shard_sizes[index]].copy_(weight)


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
        self.qkv_proj = MergedLinear(shape.hidden_size, [self.q_size, self.kv_size, self.kv_size])
        self.o_proj = Linear(self.q_size, shape.hidden_size)
        # per-head RMSNorm of q and k over head_dim, applied after the projection and before RoPE
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, ops)

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[tokens, heads, head_dim]` queries, keys and values, q and k normed and rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.ops.qk_norm_rope(q.view(-1, self.num_heads, self.head_dim),
                                     k.view(-1, self.num_kv_heads, self.head_dim),
                                     self.q_norm.weight, self.k_norm.weight, rope.cos, rope.sin, rope.positions, self.eps)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.ops, self.split = ops, split
        self.gate_up_proj = MergedLinear(shape.hidden_size, [shape.intermediate_size] * 2)
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.down_proj(self.ops.swiglu(x, self.gate_up_proj.weight)), self.split)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.split = split
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.self_attn = Attention(shape, ops, split)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.mlp = MLP(shape, ops, split)

    # A layer is split at its attention, whose work depends on the batch's sequences and not only on its token
    # count; the rest is row by row. Residual adds are deferred into the next norm (one fused kernel on GPU).

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope) -> QKV:
        x, residual = self.input_layernorm(x, residual)
        return QKV(*self.self_attn.qkv(x, rope), residual)

    def post_attention(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`out`: the attention's `[tokens, heads, head_dim]`; returns (the layer's output, residual)."""
        attended = all_reduce(self.self_attn.o_proj(out.flatten(1)), self.split)
        x, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(x), residual


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


class Qwen3Model(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size, split)
        self.layers = nn.ModuleList(DecoderLayer(shape, ops, split) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, rope: Rope, batch: AttentionBatch) -> torch.Tensor:
        """Piece 0, attention 0, piece 1, ..., attention L-1, piece L (see `piece`)."""
        out = self.piece(0, input_ids, None, rope)
        for i, layer in enumerate(self.layers):
            attention = batch.attend(i, out.q, out.k, out.v, layer.self_attn.scale)
            out = self.piece(i + 1, attention, out.residual, rope)
        return out

    def piece(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope) -> QKV | torch.Tensor:
        """Everything between attention i-1 and attention i: from the token ids (i = 0) or attention i-1's
        output with its residual, to layer i's q/k/v with the residual, or the final hidden states (i = L).
        A piece's work depends only on its token count, so CUDA graphs can capture it (engine.model.cuda_graphs)."""
        if i == 0:
            x = self.embed_tokens(x)
        else:
            x, residual = self.layers[i - 1].post_attention(x, residual)
        if i == len(self.layers):
            return self.norm(x, residual)[0]
        return self.layers[i].pre_attention(x, residual, rope)


class Qwen3ForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused module, shard index)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, shape: ModelShape, ops: Ops, split: Split = ALONE) -> None:
        """`shape`: the rank's (`rank_shape`)."""
        super().__init__()
        self.shape, self.split = shape, split
        self.model = Qwen3Model(shape, ops, split)
        tied = self.model.embed_tokens.weight if shape.tie_word_embeddings else None
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size // split.world, tied)
        cos, sin = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta,
                               self.lm_head.weight.device, shape.yarn)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; `compute_logits` turns the rows that sample into logits."""
        return self.model(input_ids, Rope(self.rope_cos, self.rope_sin, positions), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank."""
        return gather_columns(self.lm_head(hidden).float(), self.split)
