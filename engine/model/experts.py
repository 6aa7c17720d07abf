"""A mixture-of-experts layer's expert weights, and how checkpoints name them.

We hold each layer's experts stacked, the layout the fused kernels read (`kernels.fused_moe_ref`) and the one
transformers keeps in memory: `gate_up_proj [experts, 2 * intermediate, hidden]` (each expert's gate rows, then
its up rows) and `down_proj [experts, hidden, intermediate]`. Checkpoints store them either way: Qwen3-MoE
folders on the hub, and transformers' `save_pretrained`, write each expert apart
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); a stacked checkpoint (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, without `.weight`) is read as its experts one by one (`unstack`), so the loader sees
one layout and a tensor-parallel rank slices every expert's tensors as it slices the dense MLP's.

An FP8 checkpoint (Qwen's `*-FP8`) quantizes every expert's projections like the dense ones (engine.model.fp8):
each has its `weight` in fp8 and its `weight_scale_inv`, one scale per 128x128 block, and `Fp8Experts` keeps
them so, stacked beside their scales (`gate_up_proj_scale_inv`, the gate's scale rows then the up's, and
`down_proj_scale_inv`: transformers' names, which a stacked checkpoint uses too).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from engine.model.fp8 import FP8, MLP_PROJECTIONS, SCALES, blocks, check_checkpoint_tensor
from kernels.dispatch import Ops
from kernels.fp8_gemm import BLOCK

_PER_EXPERT = re.compile(r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         rf"\.(?P<leaf>weight|{SCALES})")
_STACKED = re.compile(r"(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<scales>_scale_inv)?")


class Experts(nn.Module):
    """Every expert of one layer (this rank's slice of each under tensor parallelism), run as one fused
    computation over the tokens routed to them."""

    leaves = ("weight",)  # each projection's checkpoint tensors

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Ops,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ops, self.num_experts, self.intermediate_size = ops, num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x [tokens, hidden]`, each token's experts `ids [tokens, top_k]` and their `weights`."""
        return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def stack(self, proj: str, leaf: str) -> nn.Parameter:
        """The stacked parameter that holds projection `proj`'s tensor `leaf` of every expert."""
        return getattr(self, ("down_proj" if proj == "down_proj" else "gate_up_proj")
                       + ("_scale_inv" if leaf == SCALES else ""))

    def load(self, name: str, expert: int, proj: str, leaf: str, tensor: torch.Tensor) -> None:
        """Fill one expert's projection (`gate_proj`, `up_proj` or `down_proj`) from its checkpoint tensor `name`,
        its `weight` or, in an FP8 checkpoint, its `weight_scale_inv`."""
        stack = self.stack(proj, leaf)
        check_checkpoint_tensor(name, tensor, stack)
        if proj == "down_proj":
            stack.data[expert].copy_(tensor)
            return
        rows = blocks(self.intermediate_size) if leaf == SCALES else self.intermediate_size
        start = 0 if proj == "gate_proj" else rows  # the up projection starts scale rows of its own
        stack.data[expert, start:start + rows].copy_(tensor)

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The tensors a checkpoint holds for these experts, each expert apart; `prefix`: this module's name."""
        return [f"{prefix}.{e}.{proj}.{leaf}" for e in range(self.num_experts) for proj in MLP_PROJECTIONS
                for leaf in self.leaves]


class Fp8Experts(Experts):
    """`Experts` whose weights are fp8, each expert's projections with their own 128x128 block scales."""

    leaves = ("weight", SCALES)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Ops) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, ops, FP8)
        gate_up = (num_experts, 2 * blocks(intermediate_size), blocks(hidden_size))
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(gate_up, dtype=torch.float32), requires_grad=False)
        down = (num_experts, blocks(hidden_size), blocks(intermediate_size))
        self.down_proj_scale_inv = nn.Parameter(torch.empty(down, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.fp8_fused_moe(x, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                                      self.down_proj_scale_inv, weights, ids)


def expert_tensor(name: str) -> tuple[str, int, str, str] | None:
    """(the `Experts` module's name, the expert, the projection, the tensor: `weight` or `weight_scale_inv`) of a
    checkpoint tensor that is one expert's; None for any other tensor."""
    match = _PER_EXPERT.fullmatch(name)
    return None if match is None else (match["module"], int(match["expert"]), match["proj"], match["leaf"])


def unstack(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked checkpoint tensor as its experts' tensors (views, under the per-expert names); any other as it is."""
    match = _STACKED.fullmatch(name)
    if match is None:
        yield name, tensor
        return
    module, leaf = match["module"], SCALES if match["scales"] else "weight"
    if match["proj"] == "gate_up_proj" and tensor.dtype == FP8 and (tensor.shape[1] // 2) % BLOCK:
        raise ValueError(f"{name}: stacked FP8 experts of width {tensor.shape[1] // 2} share a {BLOCK}-row scale "
                         "block between each expert's gate and up rows; at such widths only checkpoints of experts "
                         "apart are read")
    for e, part in enumerate(tensor):
        if match["proj"] == "down_proj":
            yield f"{module}.{e}.down_proj.{leaf}", part
        else:
            gate, up = part.chunk(2)
            yield f"{module}.{e}.gate_proj.{leaf}", gate
            yield f"{module}.{e}.up_proj.{leaf}", up
