"""Block-scaled FP8 matrix multiplies (DeepSeek's and Qwen's FP8 checkpoints): Triton kernels, their PyTorch
references, and the dequantizing path for devices without FP8 tensor cores.

A weight `[out, in]` is stored as `float8_e4m3fn` with one float32 scale per 128x128 block (`weight_scale_inv`,
`[ceil(out / 128), ceil(in / 128)]`): a weight's value is its fp8 value times its block's scale. A fused
projection keeps each of its shards' own scale rows, so an output row finds its scale row through `scale_rows`
(`[out]` int32) rather than by dividing its index by 128 (engine.model.fp8 lays them out).

On GPUs with FP8 tensor cores (compute capability 8.9 and up) `fp8_linear` multiplies W8A8: the activations
are quantized per token and per group of 128 along K (one scale each, the largest magnitude over 448), then a
tiled GEMM multiplies fp8 by fp8 one 128-wide K step at a time, scales each step's product by its activation
and weight scales and sums in float32. Elsewhere `dequant_linear` expands the weight to the activations' dtype
for each matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.tile_order import grouped_tile

BLOCK = 128  # the side of a weight's scale block, and the width of an activation's scale group along K
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
EPS = 1e-10  # the smallest magnitude a scale is taken from: an all-zero block must not divide by zero


def blocks(n: int) -> int:
    """How many 128-blocks `n` rows or columns span (the last one may be partial)."""
    return -(-n // BLOCK)


def scale_rows(shard_sizes: list[int]) -> torch.Tensor:
    """Each output row's row of scales in a weight of `shard_sizes` stacked shards: every shard starts a scale
    row of its own."""
    starts = [sum(blocks(s) for s in shard_sizes[:i]) for i in range(len(shard_sizes))]
    return torch.cat([torch.arange(size, dtype=torch.int32) // BLOCK + start
                      for size, start in zip(shard_sizes, starts, strict=True)])


def block_quantize(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` as fp8 `[M, K]` and float32 scales `[ceil(M / rows), ceil(K / cols)]`, one per `rows` x
    `cols` block, each its block's largest magnitude over 448: weights take 128x128 blocks, activations 1x128."""
    m, k = x.shape
    padded = F.pad(x.float(), (0, -k % cols, 0, -m % rows))
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=EPS) / FP8_MAX
    quantized = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.view(padded.shape)[:m, :k].contiguous(), scales


def fp8_halves(q: torch.Tensor) -> torch.Tensor:
    """e4m3 `q`'s values over 256, in float16: each byte's exponent and mantissa moved into float16's places
    (whose exponent bias is 8 more), its sign kept. Exact for every finite value, subnormals included, and on a
    CPU several times faster than PyTorch's cast, which converts fp8 one value at a time; e4m3fn's one NaN
    pattern, which no quantized weight holds, reads as 480."""
    bits = q.view(torch.int8).to(torch.int16)  # sign-extended: the sign lands on float16's sign bit
    sign = bits & -32768
    return bits.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16)


def block_dequantize(q: torch.Tensor, scales: torch.Tensor, scale_rows: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of fp8 `q [M, K]`: each row's fp8 values times the scales of its row of `scales` (which
    `scale_rows [M]` names), one per 128 columns; the product is taken in float32, then cast to `dtype`."""
    m, k = q.shape
    values = fp8_halves(q).float()
    values = (F.pad(values, (0, -k % BLOCK)) if k % BLOCK else values).view(m, blocks(k), BLOCK)
    # times 256 undoes fp8_halves' division exactly (a power of two), so each product rounds once, as fp8 * scale
    values.mul_(scales.index_select(0, scale_rows.long())[:, :, None] * 256)
    return values.view(m, blocks(k) * BLOCK)[:, :k].to(dtype).contiguous()


def dequant_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, scale_rows: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ b)` with the fp8 weight dequantized to `x`'s dtype for this one matmul: devices without FP8
    tensor cores (CPUs, GPUs before compute capability 8.9)."""
    return F.linear(x, block_dequantize(weight, scales, scale_rows, x.dtype), bias)


def quantize_groups_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` as fp8 and float32 scales `[M, ceil(K / 128)]`, one per token and group of 128."""
    return block_quantize(x, 1, BLOCK)


def w8a8_gemm_ref(xq: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  scale_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`xq @ W.T`, each operand dequantized in float32, the product cast to `dtype`."""
    a = block_dequantize(xq, x_scales, torch.arange(xq.shape[0], device=xq.device))
    return (a @ block_dequantize(weight, scales, scale_rows).T).to(dtype)


def over_rows(x: torch.Tensor, bias: torch.Tensor | None,
              gemm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`gemm` of `x [..., K]` as one matrix of contiguous rows, plus `bias`, in `x`'s leading shape."""
    out = gemm(x.reshape(-1, x.shape[-1]).contiguous())
    out = out if bias is None else out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, scale_rows: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `fp8_linear` computes: `x [..., K]` quantized per token group, times the fp8 weight."""
    return over_rows(x, bias, lambda rows: w8a8_gemm_ref(*quantize_groups_ref(rows), weight, scales, scale_rows,
                                                          x.dtype))


@triton.jit
def _quantize_groups_kernel(
    x, out, scales, M, K, stride_xm, stride_om, stride_sm,
    ROWS: tl.constexpr, GROUP: tl.constexpr, LIMIT: tl.constexpr, EPSILON: tl.constexpr,
):
    # one program: ROWS tokens' values in one group of GROUP columns
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    rk = group * GROUP + tl.arange(0, GROUP)
    live = (rm[:, None] < M) & (rk[None, :] < K)
    v = tl.load(x + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=live, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), EPSILON) / LIMIT
    q = tl.clamp(v / scale[:, None], -LIMIT, LIMIT)
    tl.store(out + rm.to(tl.int64)[:, None] * stride_om + rk[None, :], q.to(out.dtype.element_ty), mask=live)
    tl.store(scales + rm.to(tl.int64) * stride_sm + group, scale, mask=rm < M)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups_ref`, on Triton: `x [M, K]` with contiguous rows."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("x needs contiguous rows")
    out = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, triton.cdiv(k, BLOCK), device=x.device, dtype=torch.float32)
    rows = 16
    _quantize_groups_kernel[(triton.cdiv(m, rows), triton.cdiv(k, BLOCK))](
        x, out, scales, m, k, x.stride(0), out.stride(0), scales.stride(0),
        ROWS=rows, GROUP=BLOCK, LIMIT=FP8_MAX, EPSILON=EPS,
    )
    return out, scales


@triton.jit
def _w8a8_kernel(
    a, a_scales, w, w_scales, scale_rows, out, M, N, K, M_BUCKET, stride_am, stride_asm, stride_wn, stride_wsn,
    stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # M_BUCKET only keys the autotuner. BLOCK_K is the scale group: each K step has one scale per row and column.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    w_ptrs = w + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] of W.T
    a_scale_ptrs = a_scales + rm.to(tl.int64) * stride_asm
    # each output column's row of weight scales: its shard's own, wherever the shard starts
    w_scale_ptrs = w_scales + tl.load(scale_rows + rn, mask=rn < N, other=0) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # masks along K only where K has a partial step: a K mask keeps the compiler from pipelining the loads
        k_left = BLOCK_K if EVEN_K else K - k * BLOCK_K
        x_tile = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w_tile = tl.load(w_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        a_scale = tl.load(a_scale_ptrs + k, mask=rm < M, other=0.0)
        w_scale = tl.load(w_scale_ptrs + k, mask=rn < N, other=0.0)
        # each step's fp8 product is scaled and summed in float32 (the tensor cores' own fp8 accumulation is
        # short of float32's precision over long K)
        acc += tl.dot(x_tile, w_tile) * (a_scale[:, None] * w_scale[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _gpu_configs() -> list[triton.Config]:
    # 128x128 tiles on 8 warps spill registers on Hopper (kernels.compile_check): the per-column weight scales
    # take the room
    shapes = [(16, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
              (128, 64, 4, 3)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=warps, num_stages=stages)
            for bm, bn, warps, stages in shapes]


_tuned_kernel = triton.autotune(configs=_gpu_configs(), key=["M_BUCKET", "N", "K"])(_w8a8_kernel)
# The interpreter runs on CPU where timing configs means nothing: one small fixed tile.
_INTERPRETER_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 2}


def w8a8_gemm(xq: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
              scale_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`w8a8_gemm_ref`, on Triton: fp8 `xq [M, K]` with its group scales, fp8 `weight [N, K]` with its block
    scales and `scale_rows`, into a new `[M, N]` of `dtype`."""
    m, k = xq.shape
    n = weight.shape[0]
    if xq.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[1] != k:
        raise ValueError("xq and weight need contiguous rows of the same length")
    out = torch.empty(m, n, device=xq.device, dtype=dtype)
    args = (xq, x_scales, weight, scales, scale_rows, out, m, n, k, triton.next_power_of_2(m), xq.stride(0),
            x_scales.stride(0), weight.stride(0), scales.stride(0), out.stride(0))

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    even = k % BLOCK == 0
    if xq.is_cuda:
        _tuned_kernel[grid](*args, BLOCK_K=BLOCK, EVEN_K=even)
    else:
        _w8a8_kernel[grid](*args, BLOCK_K=BLOCK, EVEN_K=even, **_INTERPRETER_TILE)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, scale_rows: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_ref`, on Triton: `x [..., K]` quantized per token group, then the W8A8 GEMM."""
    return over_rows(x, bias, lambda rows: w8a8_gemm(*quantize_groups(rows), weight, scales, scale_rows, x.dtype))


def has_fp8_tensor_cores(device: torch.device | str) -> bool:
    """Whether `device` multiplies fp8 by fp8 in hardware: NVIDIA GPUs of compute capability 8.9 and up."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))
