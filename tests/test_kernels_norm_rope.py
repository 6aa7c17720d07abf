"""Fused RMSNorm (+ residual) and q/k-norm + RoPE against their references, in Triton's interpreter (fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import qk_norm_rope, rms_norm, torch_ops
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(rms_norm, qk_norm_rope)

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize(("rows", "hidden"), [(1, 16), (5, 33), (3, 128), (4, 100)])
def test_rms_norm(rows, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    assert_close(rms_norm.rms_norm(x, weight, 1e-6), rms_norm.rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("shape", [(2, 3, 48), (7, 64)])
def test_add_rms_norm(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, residual = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen)
    normed, summed = rms_norm.add_rms_norm(x, residual, weight, 1e-5)
    normed_ref, summed_ref = rms_norm.add_rms_norm_ref(x, residual, weight, 1e-5)
    assert_close(normed, normed_ref)
    assert torch.equal(summed, summed_ref)


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [(9, 6, 2, 32), (1, 4, 4, 16), (5, 16, 2, 64)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "rope-alone"])
def test_qk_norm_rope_on_views_of_a_fused_projection(tokens, heads, kv_heads, head_dim, norm):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)
    cos, sin = qk_norm_rope.rope_tables(64, head_dim, 1e6)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    if not norm:  # Llama, Mistral, Qwen2: RoPE alone
        q_weight = k_weight = None
    args = (q, k, q_weight, k_weight, cos, sin, positions, 1e-6)
    for out, ref, x in zip(qk_norm_rope.qk_norm_rope(*args), qk_norm_rope.qk_norm_rope_ref(*args), (q, k),
                           strict=True):
        assert_close(out, ref)
        if not norm:  # a rotation keeps each head's length
            assert_close(out.norm(dim=-1), x.norm(dim=-1))
    fast = torch_ops.qk_norm_rope(*args)
    for out, ref in zip(fast, qk_norm_rope.qk_norm_rope_ref(*args), strict=True):
        assert_close(out, ref)


def test_rope_tables_follow_the_rotary_formula():
    cos, sin = qk_norm_rope.rope_tables(10, 8, 10000.0)
    angle = 7 * 10000.0 ** (-2 * 3 / 8)  # position 7, frequency index 3
    assert math.isclose(cos[7, 3].item(), math.cos(angle), rel_tol=1e-6)
    assert math.isclose(sin[7, 3].item(), math.sin(angle), rel_tol=1e-6)
