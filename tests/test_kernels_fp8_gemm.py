"""The block-scaled FP8 kernels against their references in Triton's interpreter, and the dequantizing path.

The interpreter multiplies fp8 by fp8 (`tl.dot` on float8_e4m3fn tiles), so the GEMM is tested on fp8 operands
as a GPU runs it. Its float32 -> e4m3 casts round some values just below a power of two down to half of it, so
the activation quantizer is tested on values it maps exactly onto fp8 ones (every group's largest magnitude an
fp8 value times a power of two); `bench/gpu_kernels.py` checks the rounding itself on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.fp8 import scale_rows
from kernels import fp8_gemm, fused_moe, torch_ops
from kernels.dispatch import select_ops
from tests.test_kernels_support import assert_close, interpret_kernels

interpreted_kernels = interpret_kernels(fp8_gemm)
FP8 = torch.float8_e4m3fn


def exact_activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Activations whose groups quantize exactly: fp8 values with a +-448 in every group, times a power of two
    per row, so each scale is a power of two and each quotient an fp8 value."""
    values = (torch.randn(rows, k, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    values[:, ::fp8_gemm.BLOCK] = 448.0 * torch.sign(torch.randn(rows, 1, generator=gen))
    return values * 2.0 ** torch.randint(-12, 4, (rows, 1), generator=gen).float()


def weights(shards: list[int], k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused fp8 weight of `shards`, each quantized on its own, its stacked scales and each row's scale row."""
    parts = [fp8_gemm.block_quantize(torch.randn(n, k, generator=gen) * 0.1, fp8_gemm.BLOCK, fp8_gemm.BLOCK)
             for n in shards]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), scale_rows(shards)


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize(("rows", "k"), [(1, 128), (5, 200), (37, 384)])
def test_quantize_groups_matches_reference(rows, k):
    gen = torch.Generator().manual_seed(rows)
    x = exact_activations(rows, k, gen)
    q, scales = fp8_gemm.quantize_groups(x)
    q_ref, scales_ref = fp8_gemm.quantize_groups_ref(x)
    assert torch.equal(scales, scales_ref) and scales.shape == (rows, -(-k // fp8_gemm.BLOCK))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # any values: the scales are the same computation (the largest magnitude over 448) however casts round
    noisy = torch.randn(rows, k, generator=gen) * 3
    assert torch.equal(fp8_gemm.quantize_groups(noisy)[1], fp8_gemm.quantize_groups_ref(noisy)[1])


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize(("m", "shards", "k"), [
    (1, [256], 128),
    (37, [256, 64, 64], 200),  # q/k/v with 64-row K and V shards, a partial K step
    (20, [576, 576], 384),  # gate/up of 4.5 blocks each: the up shard starts mid-block
])
def test_w8a8_gemm_matches_reference(m, shards, k):
    gen = torch.Generator().manual_seed(m)
    xq, x_scales = fp8_gemm.quantize_groups_ref(torch.randn(m, k, generator=gen))
    weight, scales, rows = weights(shards, k, gen)
    out = fp8_gemm.w8a8_gemm(xq, x_scales, weight, scales, rows, torch.float32)
    assert_close(out, fp8_gemm.w8a8_gemm_ref(xq, x_scales, weight, scales, rows, torch.float32), rel=1e-5)


@pytest.mark.usefixtures("poisoned_allocations")
def test_fp8_linear_matches_reference_over_any_leading_shape():
    gen = torch.Generator().manual_seed(3)
    x = exact_activations(2 * 9, 256, gen).view(2, 9, 256)
    weight, scales, rows = weights([128, 64], 256, gen)
    bias = torch.randn(192, generator=gen)
    out = fp8_gemm.fp8_linear(x, weight, scales, rows, bias)
    assert out.shape == (2, 9, 192)
    assert_close(out, fp8_gemm.fp8_linear_ref(x, weight, scales, rows, bias), rel=1e-5)


def test_block_quantize_keeps_each_value_within_an_fp8_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[128:256, 128:] = 0.0  # a block of zeros keeps a finite scale
    q, scales = fp8_gemm.block_quantize(w, fp8_gemm.BLOCK, fp8_gemm.BLOCK)
    assert q.dtype == FP8 and scales.shape == (3, 2) and scales.isfinite().all()
    back = fp8_gemm.block_dequantize(q, scales, scale_rows([300]))
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 1/16 of itself, a subnormal (spaced 2^-9
    # apart) by half of that spacing, each times its block's scale
    scale = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2.0**-10).all()
    assert torch.equal(back[128:256, 128:], torch.zeros(128, 72))


def test_dequantized_values_are_each_fp8_value_times_its_scale_bit_for_bit():
    """The dequantizing path reads fp8 through float16 (`fp8_halves`): every finite e4m3 value, normal and
    subnormal, times scales large and small, rounds as PyTorch's own cast times the scale does."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    finite = every[every.float().isfinite()]
    q = finite.repeat(3, 1)
    scales = torch.tensor([[1e-3, 7.3], [0.011, 3e-5], [2.5e-7, 1.0]])
    expected = q.float() * scales.repeat_interleave(fp8_gemm.BLOCK, 1)[:, :finite.numel()]
    assert finite.numel() == 254 and torch.equal(fp8_gemm.block_dequantize(q, scales, torch.arange(3)), expected)


def test_dequant_linear_multiplies_by_each_shards_dequantized_rows():
    gen = torch.Generator().manual_seed(1)
    weight, scales, rows = weights([256, 64, 64], 200, gen)
    x = torch.randn(7, 200, generator=gen)
    by_shard = torch.cat([fp8_gemm.block_dequantize(weight[a:b], scales[s:t], scale_rows([b - a]))
                          for a, b, s, t in ((0, 256, 0, 2), (256, 320, 2, 3), (320, 384, 3, 4))])
    assert torch.equal(fp8_gemm.dequant_linear(x, weight, scales, rows), F.linear(x, by_shard))


def test_fp8_tensor_cores_decide_between_the_gemm_and_dequantizing(monkeypatch):
    """FP8 experts too: W8A8 Triton kernels on FP8 tensor cores, elsewhere dequantized, on CUDA by the Triton
    kernels (a CUDA graph holds them), on a CPU by the grouped CPU version (only the chosen experts)."""
    cpu = select_ops("auto", "cpu", head_dim=32)
    assert cpu.fp8_linear is fp8_gemm.dequant_linear and cpu.fp8_fused_moe is torch_ops.fp8_fused_moe
    interpreted = select_ops("triton", "cpu", head_dim=32)
    assert interpreted.fp8_linear is fp8_gemm.dequant_linear
    assert interpreted.fp8_fused_moe is fused_moe.dequant_fused_moe
    assert select_ops("torch", "cuda", head_dim=128).fp8_fused_moe is fused_moe.dequant_fused_moe  # before sm_89
    monkeypatch.setattr(fp8_gemm, "has_fp8_tensor_cores", lambda device: torch.device(device).type == "cuda")
    triton = select_ops("triton", "cuda", head_dim=128)
    assert triton.fp8_linear is fp8_gemm.fp8_linear and triton.fp8_fused_moe is fused_moe.fp8_fused_moe
    torch_backend = select_ops("torch", "cuda", head_dim=128)
    assert torch_backend.fp8_linear is fp8_gemm.dequant_linear
    assert torch_backend.fp8_fused_moe is fused_moe.fp8_fused_moe
