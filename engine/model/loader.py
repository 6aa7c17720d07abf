"""A Hugging Face checkpoint folder (config.json + *.safetensors) of any family in `engine.model.families` into
`engine.model.decoder.CausalLM`.

Modules are built directly on the target device and dtype with empty parameters, and each checkpoint tensor
is copied straight into its parameter (or its shard of a fused one, or its expert of a stacked one), so the
weights exist once; an FP8 checkpoint's projections and experts stay fp8, with their block scales
(engine.model.fp8). A tensor-parallel rank reads only its slice of each tensor (`safe_open`'s slices are read
from the memory-mapped file), and of a projection's scales the rows or columns that go with it. Experts come per
expert or stacked (engine.model.experts).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.decoder import CausalLM
from engine.model.experts import Experts, expert_tensor, unstack
from engine.model.families import read_shape
from engine.model.fp8 import SCALES, Fp8Linear, check_checkpoint_tensor, scale_slice
from engine.model.layers import MergedLinear
from engine.model.parallel import ALONE, Split, kv_head_start, kv_heads_per_rank
from engine.model.shape import ModelShape, rank_shape
from kernels.dispatch import Ops


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
    its rows of q/k/v, gate/up (an expert's too), the embedding and the LM head, its columns of o_proj and down."""
    if not split.parallel:
        return None
    proj = name.rpartition(".")[0].rpartition(".")[2]
    heads, d = shape.num_heads // split.world, shape.head_dim
    kv = kv_heads_per_rank(shape.num_kv_heads, split.world)
    width = shape.moe.intermediate_size if shape.moe is not None and expert_tensor(name) else shape.intermediate_size
    mlp = width // split.world
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
                if where is None:  # whole, or stacked experts: sliced once told apart
                    yield from _sliced(unstack(name, f.get_tensor(name)), part)
                else:
                    dim, start, stop = where
                    piece = f.get_slice(name)
                    yield name, piece[start:stop] if dim == 0 else piece[:, start:stop]


def _sliced(tensors: Iterable[tuple[str, torch.Tensor]], part: Callable[[str], Slice]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        where = part(name)
        yield name, tensor if where is None else tensor.narrow(where[0], where[1], where[2] - where[1])


def _checkpoint_names(model: CausalLM) -> set[str]:
    """The tensor names a checkpoint must hold for `model`: fused parameters under their separate names,
    stacked experts each apart."""
    names = set()
    for name, _ in model.named_parameters():  # tied weights are listed once, under the embedding
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Experts):
            names.update(module.checkpoint_names(module_name))
            continue
        parent, _, child = module_name.rpartition(".")
        shards = [proj for proj, (fused, _) in CausalLM.packed_modules.items() if fused == child]
        parent = f"{parent}." if parent else ""
        names.update(f"{parent}{proj}.{leaf}" for proj in shards or [child])
    return names


def _fill(model: CausalLM, params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` into its parameter, its shard of a fused one or its expert's place."""
    if (expert := expert_tensor(name)) is not None:
        module_name, index, proj, leaf = expert
        model.get_submodule(module_name).load(name, index, proj, leaf, tensor)
        return
    module_name, _, leaf = name.rpartition(".")
    parent, _, proj = module_name.rpartition(".")
    if proj in CausalLM.packed_modules:
        fused, shard = CausalLM.packed_modules[proj]
        module = model.get_submodule(f"{parent}.{fused}")
        assert isinstance(module, MergedLinear | Fp8Linear)
        check_checkpoint_tensor(name, tensor, getattr(module, leaf))
        module.load_shard(shard, tensor, leaf)
    else:
        check_checkpoint_tensor(name, tensor, params[name])
        params[name].data.copy_(tensor)


def load_model(
    model_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    ops: Ops,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    split: Split = ALONE,
) -> CausalLM:
    """Our modules from the folder's config and weights (`split`'s rank's part of them); `tensors` (checkpoint
    names) replaces the *.safetensors files, e.g. weights generated on the device for a benchmark too large to
    write to disk."""
    model_path = Path(model_path)
    shape = read_shape(model_path)
    with torch.device(device), _default_dtype(dtype):
        model = CausalLM(rank_shape(shape, split), ops, split)
    params = dict(model.named_parameters())
    missing = _checkpoint_names(model)

    def part(name: str) -> Slice:
        where = rank_slice(name, shape, split)
        return scale_slice(*where) if where is not None and name.endswith(f".{SCALES}") else where

    source = (_checkpoint_tensors(model_path, part) if tensors is None
              else _sliced((t for name, tensor in tensors for t in unstack(name, tensor)), part))
    for name, tensor in source:
        if name not in missing:
            continue  # e.g. lm_head.weight written out for a tied model
        missing.discard(name)
        _fill(model, params, name, tensor)
    if missing:
        raise ValueError(f"checkpoint in {model_path} lacks {sorted(missing)[:5]}")
    return model.eval()
