"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Qwen3 without the q/k norm, with biases on q, k and v."""

from __future__ import annotations

from pathlib import Path

from engine.model.families.common import base_shape, qwen_windows
from engine.model.shape import ModelShape


def qwen2_shape(model_path: str | Path, c: dict) -> ModelShape:
    return base_shape(model_path, c, qwen_windows(model_path, c), qk_norm=False, qkv_bias=True)
