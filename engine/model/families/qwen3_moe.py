"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, and on its sparse layers a mixture of experts in place
of the dense MLP. Layer i is sparse unless `mlp_only_layers` lists it, when the model has experts and
(i + 1) is a multiple of `decoder_sparse_step`, as transformers decides; with `use_sliding_window` every layer
slides (Qwen3-MoE reads neither `layer_types` nor `max_window_layers`). Every default is transformers'
`Qwen3MoeConfig`'s."""

from __future__ import annotations

from pathlib import Path

from engine.model.families.common import base_shape, no_bias, refuse
from engine.model.shape import ModelShape, MoEShape

# Fields of other mixture-of-experts designs, each with the value that means what Qwen3-MoE computes: a config
# that sets another asks for shared experts, scaled, grouped or sigmoid routing, or dense first layers.
_OTHER_DESIGNS = {"shared_expert_intermediate_size": 0, "n_shared_experts": 0, "routed_scaling_factor": 1,
                  "scoring_func": "softmax", "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0}


def _experts(model_path: str | Path, c: dict) -> MoEShape | None:
    others = sorted(f for f, same in _OTHER_DESIGNS.items() if c.get(f) not in (None, same))
    if others:
        raise refuse(model_path, f"{others} are not supported: Qwen3-MoE's experts are routed by softmax top-k, "
                                 "with no shared expert")
    # transformers writes num_experts as num_local_experts (an alias of the same field)
    num_experts = c.get("num_experts", c.get("num_local_experts", 128))
    top_k, step = c.get("num_experts_per_tok", 8), c.get("decoder_sparse_step", 1)
    if step < 1:
        raise refuse(model_path, f"decoder_sparse_step {step} is not supported; every step-th layer is sparse")
    if num_experts and not 0 < top_k <= num_experts:
        raise refuse(model_path, f"num_experts_per_tok {top_k} is not supported with {num_experts} experts")
    dense = set(c.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(c["num_hidden_layers"]))
    if not any(sparse):
        return None
    return MoEShape(num_experts, top_k, c.get("moe_intermediate_size", 768), bool(c.get("norm_topk_prob")), sparse)


def qwen3_moe_shape(model_path: str | Path, c: dict) -> ModelShape:
    no_bias(model_path, c, "attention_bias")
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    return base_shape(model_path, c, (window or 0,) * c["num_hidden_layers"], qk_norm=True,
                      moe=_experts(model_path, c))
