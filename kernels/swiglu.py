"""The SwiGLU MLP's input side, `silu(x @ gate.T) * (x @ up.T)`, as one tiled matmul with the activation in the
epilogue (Triton), and its PyTorch reference.

The weight is the gate and up projections stacked, `w_gate_up = cat([gate, up]) [2 * intermediate, hidden]`,
so each program reads the matching gate and up rows and never writes the two intermediate products. One tile
of it (`swiglu_tile`) is what the experts' kernel (kernels.fused_moe) runs against each tile's expert, FP8
experts included (kernels.scaled_dot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.scaled_dot import GROUP, scaled_dot
from kernels.tile_order import grouped_tile


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the gate and up projections' outputs side by side, `[..., 2 * intermediate]`."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def swiglu_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x @ w_gate_up.T)


@triton.jit
def swiglu_tile(x_rows, w, rows_ok, rn, N, K, stride_wn, x_scales, w_scales, stride_ws, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    """`silu(x @ gate.T) * (x @ up.T)` for one tile, in float32: `x_rows` points at each row's first element
    (`rows_ok` masks rows past the end), `rn` are the tile's columns of the stacked `w [2 * N, K]`. With FP8
    weights (`FP8`, kernels.scaled_dot) `w_scales` points at their block scales, the gate's `ceil(N / 128)`
    rows then the up's, `stride_ws` apart, and for "w8a8" `x_scales` at each row's activation scales; else both
    are None."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_rows + rk[None, :]
    gate_ptrs = w + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] of gate.T
    up_ptrs = gate_ptrs + N * stride_wn
    gate_scales = w_scales
    up_scales = w_scales
    if FP8 != "none":  # each column's first scale: the up shard starts scale rows of its own
        gate_scales = w_scales + (rn // GROUP) * stride_ws
        up_scales = gate_scales + tl.cdiv(N, GROUP) * stride_ws
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=rows_ok[:, None] & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & (rn[None, :] < N)
        group = k * BLOCK_K // GROUP
        acc_gate = scaled_dot(acc_gate, a, gate_ptrs, w_mask, x_scales, rows_ok, gate_scales, rn < N, group, FP8,
                              PRECISION)
        acc_up = scaled_dot(acc_up, a, up_ptrs, w_mask, x_scales, rows_ok, up_scales, rn < N, group, FP8,
                            PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    return acc_gate * tl.sigmoid(acc_gate) * acc_up


@triton.jit
def _swiglu_kernel(
    x, w, out, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # M_BUCKET only keys the autotuner, so batch sizes in one power-of-two range share a tuned config.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    result = swiglu_tile(x + rm.to(tl.int64)[:, None] * stride_xm, w, rm < M, rn, N, K, stride_wn, None, None, 0,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, "none")
    o_ptrs = out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _gpu_configs() -> list[triton.Config]:
    shapes = [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
              (64, 64, 64, 4, 4), (32, 128, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in shapes
    ]


_tuned_kernel = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K"])(_swiglu_kernel)
# The interpreter runs on CPU where timing configs means nothing: one fixed tile. It steps through programs and
# their K loops one by one, so its time goes with their count, not a tile's size: 32 keeps a tiny model's MLP
# (hidden 256) a few programs, and the kernel tests' shapes still span several tiles, ragged, in M, N and K.
_INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2}


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """`swiglu_ref`, on Triton: `x [..., hidden]`, `w_gate_up [2 * intermediate, hidden]` -> `[..., intermediate]`."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1 or w_gate_up.stride(-1) != 1 or w_gate_up.shape[0] % 2:
        raise ValueError("x and w_gate_up need contiguous rows, and w_gate_up an even number of them")
    m, n = rows.shape[0], w_gate_up.shape[0] // 2
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    args = (rows, w_gate_up, out, m, n, hidden, triton.next_power_of_2(m), rows.stride(0), w_gate_up.stride(0),
            out.stride(0))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 callers want fp32 results, not tf32's

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if x.is_cuda:
        _tuned_kernel[grid](*args, PRECISION=precision)
    else:
        _swiglu_kernel[grid](*args, **_INTERPRETER_TILE, PRECISION=precision)
    return out.view(*x.shape[:-1], n)
