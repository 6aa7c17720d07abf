"""A mixture-of-experts layer's expert weights, and how checkpoints name them.

We hold each layer's experts stacked, the layout the fused kernels read (`kernels.fused_moe_ref`) and the one
transformers keeps in memory: `gate_up_proj [experts, 2 * intermediate, hidden]` (each expert's gate rows, then
its up rows) and `down_proj [experts, hidden, intermediate]`. Checkpoints store them either way: Qwen3-MoE
folders on the hub, and transformers' `save_pretrained`, write each expert apart
(`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); a stacked checkpoint (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, without `.weight`) is read as its experts one by one (`unstack`), so the loader sees
one layout and a tensor-parallel rank slices every expert's tensors as it slices the dense MLP's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from kernels.dispatch import Ops

_PER_EXPERT = re.compile(r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(?P<module>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """Every expert of one layer (this rank's slice of each under tensor parallelism), run as one fused
    computation over the tokens routed to them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Ops) -> None:
        super().__init__()
        self.ops, self.num_experts, self.intermediate_size = ops, num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x [tokens, hidden]`, each token's experts `ids [tokens, top_k]` and their `weights`."""
        return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)

    def load(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Fill one expert's projection (`gate_proj`, `up_proj` or `down_proj`) from its checkpoint tensor."""
        if proj == "down_proj":
            self.down_proj.data[expert].copy_(tensor)
            return
        start = 0 if proj == "gate_proj" else self.intermediate_size
        self.gate_up_proj.data[expert, start:start + self.intermediate_size].copy_(tensor)

    def checkpoint_names(self, prefix: str) -> list[str]:
        """The tensors a checkpoint holds for these experts, each expert apart; `prefix`: this module's name."""
        return [f"{prefix}.{e}.{proj}.weight" for e in range(self.num_experts) for proj in PROJECTIONS]


def expert_tensor(name: str) -> tuple[str, int, str] | None:
    """(the `Experts` module's name, the expert, the projection) of a checkpoint tensor that is one expert's
    projection; None for any other tensor."""
    match = _PER_EXPERT.fullmatch(name)
    return None if match is None else (match["module"], int(match["expert"]), match["proj"])


def unstack(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked checkpoint tensor as its experts' tensors (views, under the per-expert names); any other as it is."""
    match = _STACKED.fullmatch(name)
    if match is None:
        yield name, tensor
        return
    module = match["module"]
    for e, part in enumerate(tensor):
        if match["proj"] == "down_proj":
            yield f"{module}.{e}.down_proj.weight", part
        else:
            gate, up = part.chunk(2)
            yield f"{module}.{e}.gate_proj.weight", gate
            yield f"{module}.{e}.up_proj.weight", up
