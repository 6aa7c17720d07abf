"""Dispatch: references on CPU, Triton on CUDA; and the Triton ops, driven the way the engine drives them
(store a prompt's K/V, prefill, store one token, decode), agree with the reference ops."""

from __future__ import annotations

import torch

from kernels import attention, fused_moe, kv_store, qk_norm_rope, rms_norm, scaled_dot, swiglu, torch_ops
from kernels.attention_ref import paged_attention_ref
from kernels.dispatch import get_ops, reference_ops, select_ops, triton_ops
from kernels.qk_norm_rope import rope_tables
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(attention, kv_store, rms_norm, qk_norm_rope, swiglu, scaled_dot, fused_moe)


def test_cpu_and_forced_reference_get_the_reference():
    assert get_ops("cpu").backend == "reference"
    assert get_ops(torch.device("cuda"), force_reference=True).backend == "reference"


def test_engine_backends_choose_their_ops_in_one_place():
    fast = select_ops("auto", "cpu", head_dim=32)
    assert fast.backend == "torch" and fast.paged_attention is torch_ops.paged_attention
    # fp8 caches need dequantizing attention: the reference's, with the fast norms
    fp8 = select_ops("torch", "cpu", head_dim=32, scaled_kv=True)
    assert fp8.paged_attention is paged_attention_ref and fp8.rms_norm is torch_ops.rms_norm
    assert select_ops("auto", "cuda", head_dim=48).backend == "torch"  # no Triton kernel for this head size
    assert select_ops("triton", "cpu", head_dim=32).backend == "triton"
    # experts: the grouped CPU version, and on CUDA the Triton kernel whatever the attention's shapes, since the
    # CPU version's host sync could not sit in a CUDA graph
    assert fast.fused_moe is torch_ops.fused_moe
    assert select_ops("torch", "cuda", head_dim=48).fused_moe is fused_moe.fused_moe


def _step(ops, caches, k_new, v_new, q, slots, cu, lens, tables, window):
    ops.store_kv(k_new, v_new, *caches, slots)
    return ops.paged_attention(q, *caches, cu, lens, tables, 0.25, window, 2)


def test_triton_ops_agree_with_reference_ops():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, prompt = 4, 2, 16, 8, 21
    tables = torch.tensor([[3, 0, 5, 1]], dtype=torch.int32)
    slots = (tables[0].repeat_interleave(block_size) * block_size + torch.arange(32) % block_size).int()
    outputs = {}
    for ops in (reference_ops(), triton_ops()):
        gen.manual_seed(0)
        caches = [torch.zeros(6, block_size, kv_heads, head_dim) for _ in range(2)]
        results = []
        for start, count in ((0, prompt), (prompt, 1)):  # prefill, then one decode step
            k, v = (torch.randn(count, kv_heads, head_dim, generator=gen) for _ in range(2))
            q = torch.randn(count, heads, head_dim, generator=gen)
            cu = torch.tensor([0, count], dtype=torch.int32)
            lens = torch.tensor([start + count], dtype=torch.int32)
            results.append(_step(ops, caches, k, v, q, slots[start:start + count], cu, lens, tables, window=6))
        x, weight = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
        results.append(ops.rms_norm(x, weight, 1e-6))
        results.extend(ops.add_rms_norm(x, x.flip(0), weight, 1e-6))
        cos, sin = rope_tables(32, head_dim, 1e6)
        q, k = torch.randn(3, heads, head_dim, generator=gen), torch.randn(3, kv_heads, head_dim, generator=gen)
        results.extend(ops.qk_norm_rope(q, k, weight[:head_dim], weight[-head_dim:], cos, sin, torch.tensor([0, 5, 31]), 1e-6))
        results.append(ops.swiglu(x, torch.randn(48, 32, generator=gen) / 6))
        weights, ids = torch.randn(3, 4, generator=gen).softmax(-1).topk(2)
        results.append(ops.fused_moe(x, torch.randn(4, 48, 32, generator=gen) / 6,
                                     torch.randn(4, 32, 24, generator=gen) / 5, weights, ids))
        outputs[ops.backend] = results
    for ours, ref in zip(outputs["triton"], outputs["reference"], strict=True):
        assert_close(ours, ref)
