"""A sparse mixture-of-experts MLP (Qwen3-MoE's `mlp` on its sparse layers), beside the dense `MLP` of
engine.model.layers: a router picks each token's experts, the experts (engine.model.experts, fp8 in an FP8
checkpoint) run as one fused computation, and under tensor parallelism the block ends in one all-reduce, as the
dense MLP does (each rank computes its slice of every expert's MLP for the tokens routed there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.experts import Experts, Fp8Experts
from engine.model.parallel import Split, all_reduce
from engine.model.shape import ModelShape, MoEShape
from kernels.dispatch import Ops


class Router(nn.Module):
    """`mlp.gate`: each token's top-k experts and their weights, as transformers routes: logits in the model's
    dtype, softmax in float32, the top k, renormalized to sum to one when `norm_topk_prob`, cast back."""

    def __init__(self, hidden_size: int, moe: MoEShape) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`weights`, `ids`), both `[tokens, top_k]`."""
        logits = F.linear(x, self.weight)
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    def __init__(self, shape: ModelShape, ops: Ops, split: Split) -> None:
        """`shape`: the rank's (`rank_shape`), whose experts are this rank's slices."""
        super().__init__()
        assert shape.moe is not None
        self.split = split
        self.gate = Router(shape.hidden_size, shape.moe)
        experts = Fp8Experts if shape.fp8 else Experts
        self.experts = experts(shape.moe.num_experts, shape.hidden_size, shape.moe.intermediate_size, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return all_reduce(self.experts(x, weights, ids), self.split)
