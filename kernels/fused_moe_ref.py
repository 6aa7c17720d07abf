"""PyTorch reference for a mixture-of-experts layer's experts: the ground truth `kernels.fused_moe` (Triton) and
`kernels.torch_ops.fused_moe` are tested against, computed as transformers' Qwen3-MoE does, one expert at a time.

Layout (shared by every version):
- `x`: `[tokens, hidden]`, the tokens of a step packed back to back.
- `w_gate_up`: `[experts, 2 * intermediate, hidden]`, each expert's gate rows then its up rows.
- `w_down`: `[experts, hidden, intermediate]`.
- `weights`, `ids`: `[tokens, top_k]`, the routing: which experts each token goes to and the weight of each
  (already normalized as the model wants); an expert appears at most once in a token's row.

The result is `sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over a token's experts `e = ids[t, j]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over the rows `x` routed to it."""
    gate, up = F.linear(x, w_gate_up).chunk(2, -1)
    return F.linear(F.silu(gate) * up, w_down)


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(ids == expert)
        part = expert_mlp(x[token], w_gate_up[expert], w_down[expert])
        out.index_add_(0, token, part * weights[token, slot, None])
    return out
