"""Qwen3 (`Qwen3ForCausalLM`): a per-head RMSNorm of q and k before RoPE, no biases, YaRN rope scaling,
optional sliding-window layers."""

from __future__ import annotations

from pathlib import Path

from engine.model.families.common import base_shape, qwen_windows, refuse
from engine.model.shape import ModelShape


def qwen3_shape(model_path: str | Path, c: dict) -> ModelShape:
    if c.get("attention_bias"):
        raise refuse(model_path, "attention_bias: true is not supported; q/k/v/o projections have no bias")
    return base_shape(model_path, c, qwen_windows(model_path, c), qk_norm=True)
