"""config.json's `quantization_config`: which quantized checkpoints the engine loads, and the refusal, by name,
of every other.

The engine loads FP8 with 128x128 weight blocks and dynamic activation scales (`quant_method: "fp8"`, `fmt:
"e4m3"`, `weight_block_size: [128, 128]`, `activation_scheme: "dynamic"`: Qwen's `*-FP8` and DeepSeek's
checkpoints; engine.model.fp8), every q/k/v/o and MLP projection of every layer quantized, the rest (norms,
embeddings, the LM head) not. The keys transformers writes with their defaults are taken as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.model.families.common import refuse
from engine.model.fp8 import projection_names
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


def reads_fp8(model_path: str | Path, c: dict) -> bool:
    """Whether the checkpoint's projections are block-FP8; a `ValueError` naming any quantization setting the
    engine does not implement."""
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
    kept = [name for name in projection_names(c["num_hidden_layers"]) if skipped(name, skip)]
    if kept:
        raise refuse(model_path, f"quantization_config leaves {kept[:3]} unquantized: the engine loads every "
                                 "layer's projections in FP8 or none")
    return True


def skipped(name: str, patterns: list[str]) -> bool:
    """Whether a skip list leaves module `name` unquantized, as transformers reads one: a pattern matches from
    the start up to a module boundary (as a regular expression), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)
