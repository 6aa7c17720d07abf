"""Writing new K/V into the paged cache (Triton; reference `attention_ref.store_kv_ref`).

An fp8 e4m3 cache stores each value divided by its KV head's scale (`[num_kv_heads]` float32 per layer), which
the attention kernels multiply back in; a bf16/fp16/fp32 cache stores values as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SCALED: tl.constexpr,
    LIMIT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    live = (h < HEADS)[:, None]
    src_k = tl.load(k + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=live).to(tl.float32)
    src_v = tl.load(v + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=live).to(tl.float32)
    if SCALED:
        # Clamp first: e4m3 has no infinity, so an out-of-range value would turn into NaN.
        src_k = tl.clamp(src_k / tl.load(k_scale + h, mask=h < HEADS, other=1.0)[:, None], -LIMIT, LIMIT)
        src_v = tl.clamp(src_v / tl.load(v_scale + h, mask=h < HEADS, other=1.0)[:, None], -LIMIT, LIMIT)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    tl.store(k_cache + dst, src_k.to(k_cache.dtype.element_ty), mask=live)
    tl.store(v_cache + dst, src_v.to(v_cache.dtype.element_ty), mask=live)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`attention_ref.store_kv_ref`, on Triton: one program per token, all its KV heads."""
    num_tokens, heads, head_dim = k.shape
    if head_dim & (head_dim - 1) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("head_dim must be a power of two and contiguous in k and v")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("k_cache and v_cache must share a layout whose slots are evenly spaced")
    scaled = k_scale is not None
    limit = torch.finfo(k_cache.dtype).max if scaled else 0.0
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if scaled else k, v_scale if scaled else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=head_dim, SCALED=scaled, LIMIT=limit,
    )
