"""PyTorch reference for a mixture-of-experts layer's experts: the ground truth `kernels.fused_moe` (Triton) and
`kernels.torch_ops.fused_moe` are tested against, computed as transformers' Qwen3-MoE does, one expert at a time.

Layout (shared by every version):
- `x`: `[tokens, hidden]`, the tokens of a step packed back to back.
- `w_gate_up`: `[experts, 2 * intermediate, hidden]`, each expert's gate rows then its up rows.
- `w_down`: `[experts, hidden, intermediate]`.
- `weights`, `ids`: `[tokens, top_k]`, the routing: which experts each token goes to and the weight of each
  (already normalized as the model wants); an expert appears at most once in a token's row.

The result is `sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))` over a token's experts `e = ids[t, j]`.

FP8 experts (Qwen's `*-FP8` mixture-of-experts checkpoints) keep those weights in float8_e4m3fn with a float32
scale per 128x128 block of each expert's projection (kernels.fp8_gemm's layout): `gate_up_scales [experts,
2 * ceil(intermediate / 128), ceil(hidden / 128)]`, the gate's scale rows then the up's, so the up projection
starts a scale row of its own whatever the width, and `down_scales [experts, ceil(hidden / 128),
ceil(intermediate / 128)]`. `fp8_fused_moe_ref` is what the W8A8 kernels compute: each projection as
`kernels.fp8_gemm.fp8_linear_ref`, its input quantized per token and 128-group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.fp8_gemm import BLOCK, block_dequantize, block_quantize, fp8_linear_ref, scale_rows

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, its rows of x) -> its MLP's output rows


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over the rows `x` routed to it."""
    gate, up = F.linear(x, w_gate_up).chunk(2, -1)
    return F.linear(F.silu(gate) * up, w_down)


def fp8_expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                   down_scales: torch.Tensor, fp8_linear: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One fp8 expert's SwiGLU MLP, each projection through `fp8_linear` (kernels.fp8_gemm's contract)."""
    width = w_gate_up.shape[0] // 2
    gate_up = fp8_linear(x, w_gate_up, gate_up_scales, scale_rows([width, width]).to(x.device))
    gate, up = gate_up.chunk(2, -1)
    return fp8_linear(F.silu(gate) * up, w_down, down_scales, scale_rows([w_down.shape[0]]).to(x.device))


def each_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                mlp: ExpertMLP) -> torch.Tensor:
    """The weighted sum of each token's experts' outputs, every expert asked in turn for its tokens."""
    out = torch.zeros_like(x)
    for expert in range(num_experts):
        token, slot = torch.where(ids == expert)
        out.index_add_(0, token, mlp(expert, x[token]) * weights[token, slot, None])
    return out


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    return each_expert(x, weights, ids, w_gate_up.shape[0],
                       lambda e, rows: expert_mlp(rows, w_gate_up[e], w_down[e]))


def fp8_fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                      down_scales: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return each_expert(x, weights, ids, w_gate_up.shape[0], lambda e, rows: fp8_expert_mlp(
        rows, w_gate_up[e], gate_up_scales[e], w_down[e], down_scales[e], fp8_linear_ref))


def quantize_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(`w_gate_up`, `gate_up_scales`, `w_down`, `down_scales`) in fp8, laid out as above: each expert's gate, up
    and down projections quantized per 128x128 block on their own, as an FP8 checkpoint stores them."""
    width = w_gate_up.shape[1] // 2
    gate_up = [[block_quantize(shard, BLOCK, BLOCK) for shard in expert.split(width)] for expert in w_gate_up]
    down = [block_quantize(expert, BLOCK, BLOCK) for expert in w_down]
    return (torch.stack([torch.cat([q for q, _ in shards]) for shards in gate_up]),
            torch.stack([torch.cat([s for _, s in shards]) for shards in gate_up]),
            torch.stack([q for q, _ in down]), torch.stack([s for _, s in down]))


def dequantize_experts(w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                       down_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts' float32 values: (`w_gate_up`, `w_down`)."""
    width = w_gate_up.shape[1] // 2
    rows = scale_rows([width, width]).to(w_gate_up.device), scale_rows([w_down.shape[1]]).to(w_down.device)
    return (torch.stack([block_dequantize(q, s, rows[0]) for q, s in zip(w_gate_up, gate_up_scales, strict=True)]),
            torch.stack([block_dequantize(q, s, rows[1]) for q, s in zip(w_down, down_scales, strict=True)]))
