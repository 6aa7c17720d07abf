"""Qwen3 (`Qwen3ForCausalLM`): a per-head RMSNorm of q and k before RoPE, no biases, YaRN rope scaling,
optional sliding-window layers."""

from __future__ import annotations

from pathlib import Path

from engine.model.families.common import base_shape, no_bias, qwen_windows
from engine.model.shape import ModelShape


def qwen3_shape(model_path: str | Path, c: dict) -> ModelShape:
    no_bias(model_path, c, "attention_bias")
    return base_shape(model_path, c, qwen_windows(model_path, c), qk_norm=True)
