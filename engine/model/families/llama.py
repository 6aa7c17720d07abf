"""Llama 2 and 3.x (`LlamaForCausalLM`, llama3 rope scaling) and Mistral (`MistralForCausalLM`, a sliding
window over every layer when `sliding_window` is set): no q/k norm, no biases."""

from __future__ import annotations

from pathlib import Path

from engine.model.families.common import base_shape, no_bias, refuse
from engine.model.shape import ModelShape


def llama_shape(model_path: str | Path, c: dict) -> ModelShape:
    no_bias(model_path, c, "attention_bias", "mlp_bias")
    return base_shape(model_path, c, (0,) * c["num_hidden_layers"], qk_norm=False)


def mistral_shape(model_path: str | Path, c: dict) -> ModelShape:
    no_bias(model_path, c, "attention_bias", "mlp_bias")
    if c.get("layer_types"):
        raise refuse(model_path, "layer_types is not supported for model_type 'mistral' (Ministral's alternating "
                                 "attention); every layer follows sliding_window")
    window = c.get("sliding_window") or 0
    return base_shape(model_path, c, (window,) * c["num_hidden_layers"], qk_norm=False)
