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
class MoEShape:
    """The experts of a mixture-of-experts model (Qwen3-MoE): which layers route to them instead of the dense
    MLP, and how."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP width
    norm_topk_prob: bool  # a token's top-k weights renormalized to sum to one
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP


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
    fp8: bool = False  # projections and experts are fp8 with a scale per 128x128 block (engine.model.fp8)
    moe: MoEShape | None = None  # None: every layer's MLP is dense

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` routes to experts."""
        return self.moe is not None and self.moe.sparse[layer]

    def experts_per_layer(self) -> list[int]:
        """Per layer, how many experts its MLP routes to (0: the dense MLP)."""
        return [self.moe.num_experts if self.sparse(i) else 0 for i in range(self.num_layers)]

    def mlp_widths(self) -> dict[str, int]:
        """The MLP widths some layer uses, by name: the dense MLP's and each expert's."""
        sparse = [self.sparse(i) for i in range(self.num_layers)]
        widths = {}
        if not all(sparse):
            widths["MLP width"] = self.intermediate_size
        if any(sparse):
            widths["expert width"] = self.moe.intermediate_size
        return widths


# the projections of each MLP width (`ModelShape.mlp_widths`), as an FP8 refusal names them
_PROJECTIONS_OF = {"MLP width": "gate_proj, up_proj and down_proj",
                   "expert width": "the experts' gate_proj, up_proj and down_proj"}


def rank_shape(shape: ModelShape, split: Split) -> ModelShape:
    """What one of `split.world` ranks computes: its share of the heads, of the MLP and of every expert's MLP
    (the vocabulary and the hidden size stay whole: the embedding and the LM head split their rows themselves;
    every rank holds every expert and the whole router)."""
    if not split.parallel:
        return shape
    check_split(shape.num_heads, shape.num_kv_heads, shape.mlp_widths(), shape.vocab_size, split.world)
    moe = shape.moe and replace(shape.moe, intermediate_size=shape.moe.intermediate_size // split.world)
    ranked = replace(shape, num_heads=shape.num_heads // split.world,
                     num_kv_heads=kv_heads_per_rank(shape.num_kv_heads, split.world),
                     intermediate_size=shape.intermediate_size // split.world, moe=moe)
    if shape.fp8:
        d, parts = shape.head_dim, ranked.mlp_widths()
        check_block_split(split.world, {
            "q_proj and o_proj": (ranked.num_heads * d, shape.num_heads * d),
            "k_proj and v_proj": (ranked.num_kv_heads * d, shape.num_kv_heads * d),
            **{_PROJECTIONS_OF[width]: (parts[width], whole) for width, whole in shape.mlp_widths().items()},
        })
    return ranked
