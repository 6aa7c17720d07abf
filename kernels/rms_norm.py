"""RMSNorm, optionally fused with the residual add before it: Triton kernel and its PyTorch reference.

Rounding follows Qwen3's `RMSNorm`: normalize in float32, round to the input dtype, then multiply by the
weight; the residual sum is rounded to the input dtype before it is normalized, as the eager model does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`: the normalized input of the next sublayer and its residual."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, residual_out, stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    h = tl.load(x + row * stride_x + cols, mask=live, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + cols, mask=live, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(out.dtype.element_ty)
        tl.store(residual_out + row * stride_ro + cols, h, mask=live)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / N + eps)
    normed = (hf * rstd).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + cols, (normed * w).to(out.dtype.element_ty), mask=live)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    res_rows = rows if residual is None else residual.reshape(-1, hidden)
    if rows.stride(-1) != 1 or res_rows.stride(-1) != 1:
        raise ValueError("the normalized dimension must be contiguous")
    out = torch.empty_like(rows)
    summed = torch.empty_like(rows) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, res_rows, weight, out, summed, rows.stride(0), res_rows.stride(0), out.stride(0), summed.stride(0),
        eps, N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(16, max(1, block // 256)),
    )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref`, on Triton: one program per row."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_ref`, on Triton, in one pass over `x` and `residual`."""
    return _launch(x, residual, weight, eps)
