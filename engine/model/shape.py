"""The numbers and switches of a decoder-only checkpoint that our modules need, one dataclass for every family.

A family (engine.model.families) reads its config.json into a `ModelShape`; the modules (engine.model.layers,
engine.model.decoder) read only the shape, so a family differs from another in the values it sets here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model.fp8 import check_block_split
from engine.model.parallel import Split, check_split, kv_heads_per_rank
from kernels.qk_norm_rope import Llama3Rope, Yarn


@dataclass(frozen=True)
class ModelShape:
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
    llama3: Llama3Rope | None = None  # Llama 3's rope scaling (at most one of yarn and llama3)
    qk_norm: bool = True  # a per-head RMSNorm of q and k before RoPE (Qwen3)
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    family: str = "qwen3"  # config.json's model_type, for reports
    fp8: bool = False  # the layers' projections are fp8 with a scale per 128x128 block (engine.model.fp8)


def rank_shape(shape: ModelShape, split: Split) -> ModelShape:
    """What one of `split.world` ranks computes: its share of the heads and of the MLP (the vocabulary and the
    hidden size stay whole: the embedding and the LM head split their rows themselves)."""
    if not split.parallel:
        return shape
    check_split(shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.vocab_size, split.world)
    ranked = replace(shape, num_heads=shape.num_heads // split.world,
                     num_kv_heads=kv_heads_per_rank(shape.num_kv_heads, split.world),
                     intermediate_size=shape.intermediate_size // split.world)
    if shape.fp8:
        d = shape.head_dim
        check_block_split(split.world, {
            "q_proj and o_proj": (ranked.num_heads * d, shape.num_heads * d),
            "k_proj and v_proj": (ranked.num_kv_heads * d, shape.num_kv_heads * d),
            "gate_proj, up_proj and down_proj": (ranked.intermediate_size, shape.intermediate_size),
        })
    return ranked
