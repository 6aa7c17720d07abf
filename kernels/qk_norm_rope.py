"""Qwen3's per-head q/k RMSNorm followed by rotate-half RoPE, in one pass: Triton kernel and PyTorch reference.

`cos`/`sin` are `[max_positions, head_dim // 2]` float32 tables (`rope_tables`), indexed by each token's
position; rotate-half pairs element `i` with `i + head_dim // 2`. Families without the norm (Llama, Qwen2)
pass no norm weights and get RoPE alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.rms_norm import rms_norm_ref


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension, its defaults already resolved from config.json (`engine.model.loader`)."""

    factor: float
    original_max_positions: int
    attention_factor: float  # multiplies cos and sin, so every kernel reading the tables applies it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3's rope scaling, as config.json's rope dict gives it."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3Rope) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: long wavelengths are divided by `factor`, short ones kept,
    and those between blended smoothly."""
    low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
    high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_positions / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, yarn: Yarn) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: fast-rotating dims keep their frequency, slow ones are divided by
    `factor`, and a linear ramp between the two correction dims blends them."""
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(yarn.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to keep the ramp finite
    dims = torch.arange(head_dim // 2, device=inv_freq.device, dtype=inv_freq.dtype)
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def rope_tables(
    max_positions: int,
    head_dim: int,
    theta: float,
    device: torch.device | str = "cpu",
    yarn: Yarn | None = None,
    llama3: Llama3Rope | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)`, each `[max_positions, head_dim // 2]` float32: the default rotary embedding, YaRN's or
    Llama 3's."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    scale = 1.0
    if yarn is not None:
        inv_freq, scale = _yarn_inv_freq(inv_freq, head_dim, theta, yarn), yarn.attention_factor
    if llama3 is not None:
        inv_freq = _llama3_inv_freq(inv_freq, llama3)
    angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float64), inv_freq)
    return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def _norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    x1, x2 = (x if weight is None else rms_norm_ref(x, weight, eps)).float().chunk(2, -1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`q [tokens, heads, head_dim]` and `k [tokens, kv_heads, head_dim]`, normalized (given norm weights) and
    rotated."""
    cos, sin = cos[positions.long()], sin[positions.long()]
    return _norm_rope_ref(q, q_weight, cos, sin, eps), _norm_rope_ref(k, k_weight, cos, sin, eps)


@triton.jit
def _norm_rope_heads(src, dst, weight, cos, sin, token, stride_t, stride_h, eps,
                     HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    half: tl.constexpr = HEAD_DIM // 2
    partner = (d + half) % HEAD_DIM  # rotate-half pairs each element with the one half a head away
    live = h < HEADS
    row = src + token * stride_t + h * stride_h
    x = tl.load(row + d, mask=live, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner, mask=live, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        # Round the normalized value to the input dtype before the weight, as the eager RMSNorm does.
        x = (x * rstd).to(dst.dtype.element_ty).to(tl.float32) * tl.load(weight + d).to(tl.float32)
        x_partner = ((x_partner * rstd).to(dst.dtype.element_ty).to(tl.float32)
                     * tl.load(weight + partner).to(tl.float32))
    c = tl.load(cos + d % half)
    s = tl.load(sin + d % half)
    rotated = x * c + tl.where(d < half, -x_partner, x_partner) * s
    tl.store(dst + (token * HEADS + h) * HEAD_DIM + d, rotated.to(dst.dtype.element_ty), mask=live)


@triton.jit
def _qk_norm_rope_kernel(
    q, k, q_out, k_out, q_weight, k_weight, cos, sin, positions,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, eps,
    Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr, K_HEADS: tl.constexpr, K_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + token).to(tl.int64)
    cos_row = cos + pos * stride_cos
    sin_row = sin + pos * stride_cos
    _norm_rope_heads(q, q_out, q_weight, cos_row, sin_row, token, stride_qt, stride_qh, eps, Q_HEADS, Q_PAD, HEAD_DIM,
                     NORM)
    _norm_rope_heads(k, k_out, k_weight, cos_row, sin_row, token, stride_kt, stride_kh, eps, K_HEADS, K_PAD, HEAD_DIM,
                     NORM)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_ref`, on Triton: one program per token; `q` and `k` may be strided views (of a fused qkv
    projection, say) as long as head_dim is contiguous. Returns new contiguous tensors."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if head_dim < 2 or head_dim & (head_dim - 1) or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("head_dim must be a contiguous power of two")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError("cos and sin must share a layout with contiguous columns")
    q_out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    norm = q_weight is not None
    _qk_norm_rope_kernel[(tokens,)](
        q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
        Q_HEADS=q_heads, Q_PAD=triton.next_power_of_2(q_heads), K_HEADS=k_heads,
        K_PAD=triton.next_power_of_2(k_heads), HEAD_DIM=head_dim, NORM=norm,
    )
    return q_out, k_out
