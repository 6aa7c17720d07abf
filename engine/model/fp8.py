"""FP8 block-quantized weights (Qwen's `*-FP8` and DeepSeek's checkpoints): the projections that hold them, the
scales of each fused shard, a tensor-parallel rank's part of them, and weight quantization.

Such a checkpoint stores each projection's weight `[out, in]` in float8_e4m3fn and `weight_scale_inv`, one
float32 per 128x128 block (`[ceil(out / 128), ceil(in / 128)]`); its value is the fp8 value times its block's
scale. The weights stay fp8 in memory, one byte each; `ops.fp8_linear` multiplies by them (kernels.fp8_gemm).

Our model fuses q/k/v and gate/up into one matrix each. A shard's rows need not end on a block boundary (a KV
projection of 64 rows, an MLP of 4.5 blocks), so each shard keeps its own scale rows, stacked: a fused weight
of shards [512, 64, 64] has 4 + 1 + 1 scale rows, and `scale_rows` names each output row's. A tensor-parallel
rank takes a slice of rows (q/k/v, gate/up) or columns (o, down) with the matching rows or columns of scales,
so every split must fall on a block boundary: `check_block_split` refuses one that does not, by name.

A mixture-of-experts checkpoint quantizes each expert's gate, up and down projections alike, each with its own
scales (engine.model.experts keeps them, stacked).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from kernels.dispatch import Ops
from kernels.fp8_gemm import BLOCK, block_dequantize, block_quantize, blocks, scale_rows
from kernels.swiglu import silu_and_mul

FP8 = torch.float8_e4m3fn
SCALES = "weight_scale_inv"  # a quantized projection's checkpoint tensor of block scales, beside its `weight`


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's `weight` and `weight_scale_inv` for `weight [out, in]`: fp8 values and one scale per
    128x128 block, its largest magnitude over 448."""
    return block_quantize(weight, BLOCK, BLOCK)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # a dense MLP's, and each expert's


def projection_names(experts: Sequence[int]) -> list[str]:
    """The modules an FP8 checkpoint quantizes, by their names in the checkpoint, in a model whose layer i has
    `experts[i]` experts (0: a dense MLP): every layer's attention projections, and its MLP's or each expert's."""
    names = []
    for i, count in enumerate(experts):
        mlps = [f"model.layers.{i}.mlp.experts.{e}" for e in range(count)] if count else [f"model.layers.{i}.mlp"]
        names += [f"model.layers.{i}.self_attn.{p}" for p in _ATTENTION]
        names += [f"{mlp}.{p}" for mlp in mlps for p in MLP_PROJECTIONS]
    return names


def quantize_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]],
                        experts: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as an FP8 checkpoint holds them: each projection's weight (`projection_names`) in
    fp8 followed by its `weight_scale_inv`, every other tensor as it is."""
    projections = {f"{name}.weight" for name in projection_names(experts)}
    for name, tensor in tensors:
        if name in projections:
            weight, scales = quantize_weight(tensor)
            yield name, weight
            yield name.replace(".weight", f".{SCALES}"), scales
        else:
            yield name, tensor


def dequantize_weight(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of a checkpoint's fp8 `weight` and its `weight_scale_inv`, as the engine computes them."""
    return block_dequantize(weight, scales, scale_rows([weight.shape[0]]).to(weight.device))


class Fp8Linear(nn.Module):
    """`x @ W.T (+ b)` with `W` in fp8 and its block scales: one projection, or several of one input stacked
    (`shard_sizes`), each filled by `load_shard` with its own scales. Parameters start empty."""

    def __init__(self, in_features: int, shard_sizes: list[int], ops: Ops, bias: bool = False) -> None:
        super().__init__()
        self.ops, self.shard_sizes = ops, shard_sizes
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=FP8), requires_grad=False)
        scale_shape = (sum(blocks(s) for s in shard_sizes), blocks(in_features))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.register_buffer("scale_rows", scale_rows(shard_sizes), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.scale_rows, self.bias)

    def load_shard(self, index: int, tensor: torch.Tensor, leaf: str = "weight") -> None:
        """`leaf`: "weight", "weight_scale_inv" or "bias", whichever of projection `index`'s tensors `tensor` is."""
        per_row = blocks if leaf == SCALES else int
        start = sum(per_row(s) for s in self.shard_sizes[:index])
        getattr(self, leaf).data[start:start + per_row(self.shard_sizes[index])].copy_(tensor)

    def swiglu(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The MLP's `silu(x @ gate.T) * (x @ up.T)`, this being the gate and up projections stacked."""
        return silu_and_mul(self(x))


def scale_slice(dim: int, start: int, stop: int) -> tuple[int, int, int]:
    """The rows or columns of scales that go with a rank's rows or columns `start:stop` of a weight."""
    return dim, start // BLOCK, blocks(stop)


def check_block_split(world: int, widths: dict[str, tuple[int, int]]) -> None:
    """Refuses `world` ranks whose part of a quantized projection would cut its scale blocks. `widths`: for
    each group of projections split alike, (a rank's rows or columns, all of them)."""
    cut = [f"{names} into parts of {part} of {whole}" for names, (part, whole) in widths.items()
           if part % BLOCK and part != whole]
    if cut:
        raise ValueError(f"tensor_parallel={world} would split the FP8 weights off their {BLOCK}x{BLOCK} scale "
                         f"blocks: {', '.join(cut)} (each rank's part must be a multiple of {BLOCK})")


def check_checkpoint_tensor(name: str, tensor: torch.Tensor, param: torch.Tensor) -> None:
    """A tensor is fp8 in the checkpoint exactly where the engine keeps an fp8 parameter, and e4m3 there: any
    other fp8 tensor would be loaded without its scales."""
    fp8_tensor = tensor.dtype.itemsize == 1 and tensor.is_floating_point()
    if fp8_tensor == (param.dtype == FP8) and (not fp8_tensor or tensor.dtype == FP8):
        return
    if param.dtype == FP8:
        raise ValueError(f"{name} is {tensor.dtype} in the checkpoint; a quantized projection's weight must be "
                         f"{FP8}")
    raise ValueError(f"{name} is {tensor.dtype} in the checkpoint, but only the layers' q/k/v/o, MLP and expert "
                     f"projections are loaded in FP8; {name} must be unquantized")
