"""config.json's `quantization_config`: which quantized checkpoints the engine loads, and the refusal, by name,
of every other.

The engine loads FP8 with 128x128 weight blocks and dynamic activation scales (`quant_method: "fp8"`, `fmt:
"e4m3"`, `weight_block_size: [128, 128]`, `activation_scheme: "dynamic"`: Qwen's `*-FP8` and DeepSeek's
checkpoints; engine.model.fp8), every q/k/v/o and MLP projection of every layer quantized, and every expert's of
a mixture-of-experts model, the rest (norms, embeddings, the LM head, a router) not. The keys transformers writes
with their defaults are taken as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from engine.model.families.common import refuse
from engine.model.fp8 import projection_names
from engine.model.shape import ModelShape
from kernels.fp8_gemm import BLOCK

# key -> the one value the engine implements (None: the key may be absent)
_ACCEPTED = {
    "quant_method": ("fp8",),
    "fmt": ("e4m3", None),
    "activation_scheme": ("dynamic", None),  # transformers' default
    "weight_block_size": ([BLOCK, BLOCK],),
    "dequantize": (False, None),  # transformers' own loading option, which changes no weight
    "scale_fmt": ("float", None),
    "expert_dtype": ("fp8", None),
    "modules_to_convert": (None, []),
}
_SKIP_LISTS = ("modules_to_not_convert", "ignored_layers")  # the modules left unquantized (MiniMax's name)


def reads_fp8(model_path: str | Path, c: dict, shape: ModelShape) -> bool:
    """Whether the checkpoint's projections are block-FP8; a `ValueError` naming any quantization setting the
    engine does not implement. `shape`: the model's, as its family reads it."""
    quant = c.get("quantization_config")
    if not quant:
        return False
    if quant.get("quant_method") != "fp8":
        raise refuse(model_path, f"quantization_config quant_method {quant.get('quant_method')!r} is not supported; "
                                 "only 'fp8' (128x128 blocks) is")
    unknown = sorted(set(quant) - set(_ACCEPTED) - set(_SKIP_LISTS))
    if unknown:
        raise refuse(model_path, f"quantization_config keys {unknown} are not supported")
    for key, values in _ACCEPTED.items():
        if quant.get(key) not in values:
            raise refuse(model_path, f"quantization_config {key} {quant.get(key)!r} is not supported; "
                                     f"the engine implements {' or '.join(repr(v) for v in values if v is not None)}")
    skip = [pattern for key in _SKIP_LISTS for pattern in quant.get(key) or []]
    if skip:
        skipped = skips(skip)
        kept = [name for name in _quantized_modules(shape) if skipped(name)]
        if kept:
            raise refuse(model_path, f"quantization_config leaves {kept[:3]} unquantized: the engine loads every "
                                     "layer's projections and experts in FP8 or none")
    return True


def _quantized_modules(shape: ModelShape) -> list[str]:
    """Every module an FP8 checkpoint must quantize: the projections, and each layer's experts as one module,
    which is how transformers names them in memory."""
    experts = [f"model.layers.{i}.mlp.experts" for i, count in enumerate(shape.experts_per_layer()) if count]
    return [*experts, *projection_names(shape.experts_per_layer())]


def skips(patterns: list[str]) -> Callable[[str], bool]:
    """Whether the skip list `patterns` (not empty) leaves a module, by its name, unquantized, as transformers
    reads one: a pattern matches from the start up to a module boundary (as a regular expression), or as a
    suffix. One expression for the whole list: a model of 48 layers of 128 experts has 18,000 names to try."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    prefix = re.compile("|".join(f"(?:(?:{p}){boundary})" for p in patterns))
    suffixes = tuple(patterns)
    return lambda name: prefix.match(name) is not None or name.endswith(suffixes)
