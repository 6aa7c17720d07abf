"""A decoder-only transformer from the shared layers: the model every family loads into.

A layer's MLP is dense, or a sparse mixture of experts (engine.model.moe) where the shape says so. The forward
is a chain of pieces, each everything between two attentions, so that CUDA graphs can replay the pieces
(engine.model.cuda_graphs). Under tensor parallelism a rank's modules hold its slices and its shape
(`rank_shape`) counts its own heads and MLP widths; the LM head gathers the logits.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.model.attention_batch import AttentionBatch
from engine.model.layers import MLP, QKV, Attention, Embedding, Linear, RMSNorm, Rope
from engine.model.moe import SparseMoE
from engine.model.parallel import ALONE, Split, all_reduce, gather_columns
from engine.model.shape import ModelShape
from kernels.dispatch import Ops
from kernels.qk_norm_rope import rope_tables


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split, index: int) -> None:
        super().__init__()
        self.split = split
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.self_attn = Attention(shape, ops, split)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, ops)
        self.mlp = SparseMoE(shape, ops, split) if shape.sparse(index) else MLP(shape, ops, split)

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


class DecoderModel(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size, split)
        self.layers = nn.ModuleList(DecoderLayer(shape, ops, split, i) for i in range(shape.num_layers))
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


class CausalLM(nn.Module):
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
        self.model = DecoderModel(shape, ops, split)
        tied = self.model.embed_tokens.weight if shape.tie_word_embeddings else None
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size // split.world, tied)
        cos, sin = rope_tables(shape.max_position_embeddings, shape.head_dim, shape.rope_theta,
                               self.lm_head.weight.device, shape.yarn, shape.llama3)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; `compute_logits` turns the rows that sample into logits."""
        return self.model(input_ids, Rope(self.rope_cos, self.rope_sin, positions), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank."""
        return gather_columns(self.lm_head(hidden).float(), self.split)
