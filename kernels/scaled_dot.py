"""One K step of a tiled matmul `a @ w` whose weights may be FP8 with a scale per 128x128 block (Triton): the
switch that lets the experts' kernels (kernels.fused_moe, through kernels.swiglu's tile) run on bf16 and on FP8
experts alike.

`FP8` names the weights' format, a compile-time constant:
- "none": weights in the activations' dtype, one `tl.dot`;
- "w8a8": fp8 weights times fp8 activations, quantized per token and 128-wide group along K
  (kernels.fp8_gemm.quantize_groups): the fp8 product on the tensor cores, scaled by each row's activation scale
  and each column's weight scale and summed in float32, as kernels.fp8_gemm's GEMM does;
- "dequant": fp8 weights read as bytes and expanded in registers to the activations' dtype, times their scale:
  GPUs without FP8 tensor cores, on which Triton does not even load e4m3.

A K step must lie within one 128-wide group (BLOCK_K divides 128), so one scale per row and per column serves
the whole step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8_gemm import BLOCK

GROUP = tl.constexpr(BLOCK)  # the scale group along K, and the weights' scale block along N


@triton.jit
def fp8_values(bits):
    """The values of e4m3 bytes (int8) over 256, in float32, read as `kernels.fp8_gemm.fp8_halves` reads them:
    each byte's exponent and mantissa moved into float16's places, its sign kept."""
    wide = bits.to(tl.int16)  # sign-extended: the sign lands on float16's sign bit
    return (((wide & 0x7F) << 7) | (wide & -32768)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def scaled_dot(acc, a, w_ptrs, w_mask, a_scales, rows_ok, w_scales, cols_ok, group,
               FP8: tl.constexpr, PRECISION: tl.constexpr):
    """`acc + a @ w` for one K step: `a [BLOCK_M, BLOCK_K]` loaded, `w_ptrs [BLOCK_K, BLOCK_N]` (with `w_mask`)
    still to load. `a_scales` and `w_scales` point at each row's and each column's first scale (None where the
    format has none), `group` is the step's scale group along K."""
    if FP8 == "w8a8":
        a_scale = tl.load(a_scales + group, mask=rows_ok, other=0.0)
        w_scale = tl.load(w_scales + group, mask=cols_ok, other=0.0)
        acc += tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0)) * (a_scale[:, None] * w_scale[None, :])
    elif FP8 == "dequant":
        # times 256 undoes fp8_values' division exactly, so each weight rounds once, as kernels.fp8_gemm's
        # block_dequantize rounds it
        w_scale = tl.load(w_scales + group, mask=cols_ok, other=0.0) * 256.0
        w = fp8_values(tl.load(w_ptrs, mask=w_mask, other=0)) * w_scale[None, :]
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
    return acc
