"""Triton store_kv against `store_kv_ref`, fp32 and fp8 e4m3 caches, in Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_store
from kernels.attention_ref import store_kv_ref
from tests.test_kernels_support import interpret_kernels

interpreted_kernels = interpret_kernels(kv_store)

FP8 = torch.float8_e4m3fn


def _caches(dtype: torch.dtype, kv_heads: int, head_dim: int) -> list[torch.Tensor]:
    """Four NaN-filled caches: k and v for the kernel, k and v for the reference."""
    return [torch.full((5, 4, kv_heads, head_dim), float("nan")).to(dtype) for _ in range(4)]


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))


@pytest.mark.parametrize(("tokens", "kv_heads", "head_dim"), [(9, 3, 16), (1, 1, 32), (13, 8, 64)])
def test_fp32_cache(tokens, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(20, generator=gen)[:tokens].int()
    slots[::3] = -1  # skipped: those slots must stay NaN
    k_cache, v_cache, k_ref, v_ref = _caches(torch.float32, kv_heads, head_dim)
    kv_store.store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)


def test_fp8_cache_with_per_head_scales():
    """Values chosen exactly representable after scaling (the interpreter rounds fp8 casts wrongly at binade
    edges; GPU rounding is checked by bench/gpu_kernels.py), plus one out-of-range value that must clamp."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, head_dim, tokens = 3, 16, 7
    k_scale = torch.tensor([0.5, 2.0, 0.25])
    v_scale = torch.tensor([1.0, 4.0, 0.125])
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(FP8).float() * k_scale.view(-1, 1)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(FP8).float() * v_scale.view(-1, 1)
    k[0, 1, 2] = 1e6
    v[3, 0, 0] = -1e6
    slots = torch.tensor([3, -1, 0, 7, 19, 12, 2], dtype=torch.int32)
    k_cache, v_cache, k_ref, v_ref = _caches(FP8, kv_heads, head_dim)
    kv_store.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv_ref(k, v, k_ref, v_ref, slots, k_scale, v_scale)
    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)
    assert k_cache.view(-1, kv_heads, head_dim)[3, 1, 2].float() == 448.0

