"""A Hugging Face Qwen3 folder (config.json + *.safetensors) into `engine.model.qwen3.Qwen3ForCausalLM`.

Modules are built directly on the target device and dtype with empty parameters, and each checkpoint tensor
is copied straight into its parameter (or its shard of a fused one), so the weights exist once. A tensor-parallel
rank reads only its slice of each tensor (`safe_open`'s slices are read from the memory-mapped file).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.parallel import ALONE, Split, kv_head_start, kv_heads_per_rank
from engine.model.qwen3 import MergedLinear, ModelShape, Qwen3ForCausalLM, rank_shape
from kernels.dispatch import Ops
from kernels.qk_norm_rope import Yarn

# The keys a rope dict may hold, by the rope type that reads them: any other could change the math.
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_YARN_KEYS = {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate"}
SUPPORTED_ROPE_TYPES = ("default", "yarn")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATIONS = ("silu", "swish")  # transformers maps both to SiLU, which our SwiGLU computes


def _refuse(model_path: str | Path, what: str) -> ValueError:
    return ValueError(f"{Path(model_path) / 'config.json'}: {what}")


def _yarn(c: dict, rope: dict) -> Yarn:
    """The YaRN parameters, each defaulted as transformers' Qwen3Config and `_compute_yarn_parameters` do."""
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


def _check_supported(model_path: str | Path, c: dict) -> None:
    """Refuses the config.json fields our modules do not implement, rather than load a model that computes
    something else than the checkpoint means."""
    if c.get("model_type", "qwen3") != "qwen3":
        raise _refuse(model_path, f"model_type {c['model_type']!r} is not supported; only 'qwen3' is")
    if c.get("quantization_config"):
        raise _refuse(model_path, "quantized checkpoints (quantization_config) are not supported")
    if c.get("attention_bias"):
        raise _refuse(model_path, "attention_bias: true is not supported; q/k/v/o projections have no bias")
    if c.get("hidden_act", "silu") not in _ACTIVATIONS:
        raise _refuse(model_path, f"hidden_act {c['hidden_act']!r} is not supported; only 'silu' "
                                  "(alias 'swish') is")
    layer_types = c.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != c["num_hidden_layers"]:
            raise _refuse(model_path, f"layer_types lists {len(layer_types)} layers, num_hidden_layers is "
                                      f"{c['num_hidden_layers']}")
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise _refuse(model_path, f"layer types {unknown} are not supported; only {list(_LAYER_TYPES)} are")


def read_shape(model_path: str | Path) -> ModelShape:
    """What our modules need from config.json; a `ValueError` for any field that asks for math they lack."""
    c = json.loads((Path(model_path) / "config.json").read_text())
    _check_supported(model_path, c)
    num_layers = c["num_hidden_layers"]
    # transformers 5 writes rope_parameters; older configs have a top-level rope_theta and rope_scaling, which
    # transformers prefers when both are present
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse(model_path, f"rope type {rope_type!r} is not supported; supported rope types are "
                                  f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    unknown = sorted(set(rope) - _ROPE_KEYS - (_YARN_KEYS if rope_type == "yarn" else set()))
    if unknown:
        raise _refuse(model_path, f"rope parameters {unknown} are not supported for rope type {rope_type!r}")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _refuse(model_path, f"partial_rotary_factor {partial} is not supported; Qwen3 rotates whole heads")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    # 28 is Qwen3Config's default, which a config without max_window_layers gets from transformers
    layer_types = c.get("layer_types") or [
        "sliding_attention" if window and i >= c.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    return ModelShape(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=num_layers,
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        windows=tuple(window if window and t == "sliding_attention" else 0 for t in layer_types),
        yarn=_yarn(c, rope) if rope_type == "yarn" else None,
    )


def read_eos_ids(model_path: str | Path) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (Qwen lists several)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = Path(model_path) / name
        if file.exists():
            eos = json.loads(file.read_text()).get("eos_token_id")
            ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    return ids


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


Slice = tuple[int, int, int] | None  # (dim, start, stop) of a tensor a rank holds a part of; None: all of it


def rank_slice(name: str, shape: ModelShape, split: Split) -> Slice:
    """The part of checkpoint tensor `name` (of a model of `shape`, the whole model's) that `split`'s rank holds:
    its rows of q/k/v, gate/up, the embedding and the LM head, its columns of o_proj and down."""
    if not split.parallel:
        return None
    proj = name.rpartition(".")[0].rpartition(".")[2]
    heads, d = shape.num_heads // split.world, shape.head_dim
    kv = kv_heads_per_rank(shape.num_kv_heads, split.world)
    mlp = shape.intermediate_size // split.world
    vocab = shape.vocab_size // split.world
    start_kv = kv_head_start(shape.num_kv_heads, split)
    return {
        "q_proj": (0, split.rank * heads * d, (split.rank + 1) * heads * d),
        "k_proj": (0, start_kv * d, (start_kv + kv) * d),
        "v_proj": (0, start_kv * d, (start_kv + kv) * d),
        "o_proj": (1, split.rank * heads * d, (split.rank + 1) * heads * d),
        "gate_proj": (0, split.rank * mlp, (split.rank + 1) * mlp),
        "up_proj": (0, split.rank * mlp, (split.rank + 1) * mlp),
        "down_proj": (1, split.rank * mlp, (split.rank + 1) * mlp),
        "embed_tokens": (0, split.rank * vocab, (split.rank + 1) * vocab),
        "lm_head": (0, split.rank * vocab, (split.rank + 1) * vocab),
    }.get(proj)


def _checkpoint_tensors(model_path: Path, part: Callable[[str], Slice]) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                where = part(name)
                if where is None:
                    yield name, f.get_tensor(name)
                else:
                    dim, start, stop = where
                    piece = f.get_slice(name)
                    yield name, piece[start:stop] if dim == 0 else piece[:, start:stop]


def _sliced(tensors: Iterable[tuple[str, torch.Tensor]], part: Callable[[str], Slice]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        where = part(name)
        yield name, tensor if where is None else tensor.narrow(where[0], where[1], where[2] - where[1])


def _checkpoint_names(model: Qwen3ForCausalLM) -> set[str]:
    """The tensor names a checkpoint must hold for `model`: fused parameters under their separate names."""
    names = set()
    for name, _ in model.named_parameters():  # tied weights are listed once, under the embedding
        module_name, _, leaf = name.rpartition(".")
        parent, _, child = module_name.rpartition(".")
        shards = [proj for proj, (fused, _) in Qwen3ForCausalLM.packed_modules.items() if fused == child]
        parent = f"{parent}." if parent else ""
        names.update(f"{parent}{proj}.{leaf}" for proj in shards or [child])
    return names


def load_model(
    model_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    ops: Ops,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    split: Split = ALONE,
) -> Qwen3ForCausalLM:
    """Our modules from the folder's config and weights (`split`'s rank's part of them); `tensors` (checkpoint
    names) replaces the *.safetensors files, e.g. weights generated on the device for a benchmark too large to
    write to disk."""
    model_path = Path(model_path)
    shape = read_shape(model_path)
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3ForCausalLM(rank_shape(shape, split), ops, split)
    params = dict(model.named_parameters())
    missing = _checkpoint_names(model)

    def part(name: str) -> Slice:
        return rank_slice(name, shape, split)

    source = _checkpoint_tensors(model_path, part) if tensors is None else _sliced(tensors, part)
    for name, tensor in source:
        if name not in missing:
            continue  # e.g. lm_head.weight written out for a tied model
        missing.discard(name)
        parent, _, proj = name.rpartition(".")[0].rpartition(".")
        if proj in Qwen3ForCausalLM.packed_modules:
            fused, shard = Qwen3ForCausalLM.packed_modules[proj]
            module = model.get_submodule(f"{parent}.{fused}")
            assert isinstance(module, MergedLinear)
            module.load_shard(shard, tensor)
        else:
            params[name].data.copy_(tensor)
    if missing:
        raise ValueError(f"checkpoint in {model_path} lacks {sorted(missing)[:5]}")
    return model.eval()
