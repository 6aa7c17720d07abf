"""The checkpoint families the engine loads, by config.json's `model_type`: each reads its config into a
`ModelShape` of switches over the shared layers, any of them in block FP8 (engine.model.families.quantization);
anything else is refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from engine.model.families.common import refuse
from engine.model.families.llama import llama_shape, mistral_shape
from engine.model.families.quantization import reads_fp8
from engine.model.families.qwen2 import qwen2_shape
from engine.model.families.qwen3 import qwen3_shape
from engine.model.families.qwen3_moe import qwen3_moe_shape
from engine.model.shape import ModelShape

FAMILIES: dict[str, Callable[[str | Path, dict], ModelShape]] = {
    "qwen3": qwen3_shape,
    "qwen3_moe": qwen3_moe_shape,
    "qwen2": qwen2_shape,
    "llama": llama_shape,
    "mistral": mistral_shape,
}


def read_shape(model_path: str | Path) -> ModelShape:
    """What our modules need from the folder's config.json; a `ValueError` naming any field that asks for math
    they lack, or a family we do not load."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    model_type = c.get("model_type", "qwen3")
    if model_type not in FAMILIES:
        raise refuse(model_path, f"model_type {model_type!r} is not supported; supported are "
                                 f"{', '.join(sorted(FAMILIES))}")
    shape = FAMILIES[model_type](model_path, c)
    return replace(shape, fp8=reads_fp8(model_path, c, shape))
