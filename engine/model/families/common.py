"""What every family reads from config.json the same way: sizes, RoPE and its scaling, sliding-window layers,
and the refusal of fields our modules do not implement (rather than load a model that computes something else
than the checkpoint means)."""

from __future__ import annotations

import math
from pathlib import Path

from engine.model.shape import ModelShape
from kernels.qk_norm_rope import Llama3Rope, Yarn

# The keys a rope dict may hold, by the rope type that reads them: any other could change the math.
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_SCALING_KEYS = {
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
SUPPORTED_ROPE_TYPES = ("default", "yarn", "llama3")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATIONS = ("silu", "swish")  # transformers maps both to SiLU, which our SwiGLU computes


def refuse(model_path: str | Path, what: str) -> ValueError:
    return ValueError(f"{Path(model_path) / 'config.json'}: {what}")


def no_bias(model_path: str | Path, c: dict, *fields: str) -> None:
    """Refuses a config that gives the projections `fields` name a bias, which ours do not add."""
    for field in fields:
        if c.get(field):
            raise refuse(model_path, f"{field}: true is not supported; the projections have no bias")


def _yarn(c: dict, rope: dict) -> Yarn:
    """The YaRN parameters, each defaulted as transformers' configs and `_compute_yarn_parameters` do."""
    # transformers prefers a top-level original_max_position_embeddings (Phi3's layout) to the rope dict's
    original = c.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    original = original or c["max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:
        factor = c["max_position_embeddings"] / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    return Yarn(factor=float(factor), original_max_positions=int(original),
                attention_factor=float(attention_factor), beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)))


def _llama3(model_path: str | Path, rope: dict) -> Llama3Rope:
    missing = sorted(_SCALING_KEYS["llama3"] - set(rope))
    if missing:
        raise refuse(model_path, f"llama3 rope scaling lacks {missing}")
    return Llama3Rope(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                      high_freq_factor=float(rope["high_freq_factor"]),
                      original_max_positions=int(rope["original_max_position_embeddings"]))


def _rope(model_path: str | Path, c: dict) -> tuple[float, Yarn | None, Llama3Rope | None]:
    """(theta, YaRN, Llama 3 scaling) from either form transformers writes."""
    # transformers 5 writes rope_parameters; older configs have a top-level rope_theta and rope_scaling, which
    # transformers prefers when both are present
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse(model_path, f"rope type {rope_type!r} is not supported; supported rope types are "
                                 f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    unknown = sorted(set(rope) - _ROPE_KEYS - _SCALING_KEYS.get(rope_type, set()))
    if unknown:
        raise refuse(model_path, f"rope parameters {unknown} are not supported for rope type {rope_type!r}")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refuse(model_path, f"partial_rotary_factor {partial} is not supported; heads rotate whole")
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    return (theta, _yarn(c, rope) if rope_type == "yarn" else None,
            _llama3(model_path, rope) if rope_type == "llama3" else None)


def qwen_windows(model_path: str | Path, c: dict) -> tuple[int, ...]:
    """Per layer, 0 or its sliding window, as Qwen2 and Qwen3 configs decide: `layer_types` when given, else
    sliding from layer `max_window_layers` on when `use_sliding_window`."""
    num_layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise refuse(model_path, f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise refuse(model_path, f"layer types {unknown} are not supported; only {list(_LAYER_TYPES)} are")
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    # 28 is the Qwen configs' default, which a config without max_window_layers gets from transformers
    layer_types = layer_types or [
        "sliding_attention" if window and i >= c.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(window if window and t == "sliding_attention" else 0 for t in layer_types)


def base_shape(model_path: str | Path, c: dict, windows: tuple[int, ...], **switches) -> ModelShape:
    """The fields every family reads alike; `switches`: the family's own `ModelShape` fields."""
    if c.get("hidden_act", "silu") not in _ACTIVATIONS:
        raise refuse(model_path, f"hidden_act {c['hidden_act']!r} is not supported; only 'silu' (alias 'swish') is")
    theta, yarn, llama3 = _rope(model_path, c)
    return ModelShape(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        windows=windows,
        yarn=yarn,
        llama3=llama3,
        family=c.get("model_type", "qwen3"),
        **switches,
    )
