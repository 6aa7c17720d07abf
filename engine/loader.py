"""A Hugging Face Qwen3 folder (config.json + *.safetensors) into `engine.model.Qwen3ForCausalLM`.

Modules are built directly on the target device and dtype with empty parameters, and each checkpoint tensor
is copied straight into its parameter (or its shard of a fused one), so the weights exist once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import MergedLinear, ModelShape, Qwen3ForCausalLM
from kernels.dispatch import Ops


def read_shape(model_path: str | Path) -> ModelShape:
    c = json.loads((Path(model_path) / "config.json").read_text())
    num_layers = c["num_hidden_layers"]
    # transformers 5 writes rope_parameters; older configs have a top-level rope_theta
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    window = c.get("sliding_window") if c.get("use_sliding_window") else None
    layer_types = c.get("layer_types") or [
        "sliding_attention" if window and i >= c.get("max_window_layers", num_layers) else "full_attention"
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


def _checkpoint_tensors(model_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


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
) -> Qwen3ForCausalLM:
    """Our modules from the folder's config and weights; `tensors` (checkpoint names) replaces the
    *.safetensors files, e.g. weights generated on the device for a benchmark too large to write to disk."""
    model_path = Path(model_path)
    shape = read_shape(model_path)
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3ForCausalLM(shape, ops)
    params = dict(model.named_parameters())
    missing = _checkpoint_names(model)
    for name, tensor in tensors if tensors is not None else _checkpoint_tensors(model_path):
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
