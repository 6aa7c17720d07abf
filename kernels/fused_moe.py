"""A mixture-of-experts layer's experts as two grouped matmuls (Triton): `kernels.fused_moe_ref`'s contract.

The step's (token, expert) pairs are sorted by expert and each expert's run is padded to a whole number of row
tiles (`route`), so every row tile belongs to one expert. One launch then computes the gate and up projections
of every tile against its own expert's weights, SiLU-multiplied in the epilogue (`_gate_up_kernel`), and a
second the down projection, scaled by each pair's routing weight (`_down_kernel`). An expert no token chose
costs nothing, and one chosen by a few tokens costs a tile. Each pair's output has a row of its own, summed
per token at the end in the order of the token's experts, so the result does not depend on scheduling.

The padded layout is sized from the shapes alone (every expert's run padded at most one tile short of full),
and tiles past the last run return at once: nothing is read back to the host, so a CUDA graph can hold the
whole layer whatever the routing.

FP8 experts (each expert's weights in e4m3 with a scale per 128x128 block, the gate's scale rows then the up's,
`kernels.fused_moe_ref.fp8_fused_moe_ref`) run the same two kernels through their `FP8` switch
(kernels.scaled_dot): W8A8 on GPUs with FP8 tensor cores (`fp8_fused_moe`: the tokens quantized per 128-group
before gate/up, the SwiGLU rows before down, by kernels.fp8_gemm's quantizer), and each weight tile expanded in
registers elsewhere (`dequant_fused_moe`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import quantize_groups
from kernels.scaled_dot import GROUP, scaled_dot
from kernels.swiglu import swiglu_tile


def route(ids: torch.Tensor, num_experts: int, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids [tokens, top_k]` -> (`sorted_pairs`, `tile_experts`): the pair index (token * top_k + slot) at each
    row of the padded layout, `tokens * top_k` in padding rows; and the expert of each row tile, `num_experts`
    for the tiles past the last run."""
    flat = ids.flatten().long()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + tile_rows - 1) // tile_rows * tile_rows
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    # a pair's row: its expert's padded start, plus its place among the expert's pairs
    place = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    rows = padded_end[expert] - padded[expert] + place
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (tile_rows - 1), tile_rows) * tile_rows
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[rows] = order.int()
    tile_starts = torch.arange(0, capacity, tile_rows, device=ids.device)
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).int()
    return sorted_pairs, tile_experts


@triton.jit
def _tile(sorted_pairs, tile_experts, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: its expert, its rows of the padded layout, the pair at each row, its N-columns."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // tiles_n
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(tile_experts + pid_m), rm, tl.load(sorted_pairs + rm), rn


@triton.jit
def _gate_up_kernel(
    x, w, out, sorted_pairs, tile_experts, x_scales, w_scales, num_pairs, num_experts, N, K, stride_xm, stride_we,
    stride_wn, stride_om, stride_xs, stride_se, stride_ws, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """`out[row] = silu(x[token] @ gate_e.T) * (x[token] @ up_e.T)` for the rows of one tile and N-columns."""
    expert, rm, pair, rn = _tile(sorted_pairs, tile_experts, N, BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    row_scales = x_scales
    expert_scales = w_scales
    if FP8 == "w8a8":
        row_scales = x_scales + token * stride_xs
    if FP8 != "none":
        expert_scales = w_scales + expert.to(tl.int64) * stride_se
    result = swiglu_tile(x + token[:, None] * stride_xm, w + expert.to(tl.int64) * stride_we, valid, rn, N, K,
                         stride_wn, row_scales, expert_scales, stride_ws, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, FP8)
    # padding rows are written too (zeros): the down kernel reads whole tiles
    o_ptrs = out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=rn[None, :] < N)


@triton.jit
def _down_kernel(
    h, w, out, sorted_pairs, tile_experts, weights, h_scales, w_scales, num_pairs, num_experts, N, K, stride_hm,
    stride_we, stride_wn, stride_om, stride_hs, stride_se, stride_ws, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """`out[pair] = weights[pair] * (h[row] @ down_e.T)` for the rows of one tile and N-columns."""
    expert, rm, pair, rn = _tile(sorted_pairs, tile_experts, N, BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    valid = pair < num_pairs
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h + rm.to(tl.int64)[:, None] * stride_hm + rk[None, :]
    w_ptrs = w + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    row_scales = h_scales
    col_scales = w_scales
    if FP8 == "w8a8":
        row_scales = h_scales + rm.to(tl.int64) * stride_hs
    if FP8 != "none":
        col_scales = w_scales + expert.to(tl.int64) * stride_se + (rn // GROUP) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(h_ptrs, mask=rk[None, :] < k_left, other=0.0)
        w_mask = (rk[:, None] < k_left) & (rn[None, :] < N)
        acc = scaled_dot(acc, a, w_ptrs, w_mask, row_scales, valid, col_scales, rn < N, k * BLOCK_K // GROUP, FP8,
                         PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)
    o_ptrs = out + pair.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, (acc * scale[:, None]).to(out.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))


# The interpreter runs on CPU, where tile sizes only change how many programs it steps through one by one.
_INTERPRETER_TILE = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 1}


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: as many as an expert's run holds on average, from 16 (a decode step over many experts,
    where larger tiles would be mostly padding) to 64."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 24 else 32 if per_expert <= 48 else 64


def launch_options(rows: int, on_gpu: bool, fp8: str = "none") -> dict:
    """Column and depth tiles, warps and pipeline stages for tiles of `rows` rows; `fp8` (kernels.scaled_dot):
    the experts' weights."""
    if not on_gpu:
        return _INTERPRETER_TILE
    # a W8A8 step reads fp8 from both sides: 128 of them (one scale group) are the bytes 64 bf16 are
    depth = 128 if fp8 == "w8a8" else 64
    return {"BLOCK_N": 64, "BLOCK_K": depth, "num_warps": 4, "num_stages": 3 if rows < 64 else 2}


def _experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, fp8: str, gate_up_scales: torch.Tensor | None = None,
             down_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Both grouped matmuls, the experts' weights in the format `fp8` names (kernels.scaled_dot), and for
    "w8a8" each matmul's input quantized per token and 128-group first."""
    if x.stride(-1) != 1 or not w_gate_up.is_contiguous() or not w_down.is_contiguous():
        raise ValueError("x needs contiguous rows, and the expert weights must be contiguous")
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = ids.shape[1]
    pairs = tokens * top_k
    rows = tile_rows(pairs, num_experts)
    sorted_pairs, tile_experts = route(ids, num_experts, rows)
    options = launch_options(rows, x.is_cuda, fp8)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 callers want fp32 results, not tf32's
    a, a_scales = quantize_groups(x) if fp8 == "w8a8" else (x, None)
    h = torch.empty(sorted_pairs.numel(), inter, device=x.device, dtype=x.dtype)
    grid = (tile_experts.numel() * triton.cdiv(inter, options["BLOCK_N"]),)
    _gate_up_kernel[grid](a, w_gate_up, h, sorted_pairs, tile_experts, a_scales, gate_up_scales, pairs, num_experts,
                          inter, hidden, a.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
                          *_scale_strides(a_scales, gate_up_scales), TOP_K=top_k, BLOCK_M=rows, PRECISION=precision,
                          FP8=fp8, **options)
    a, a_scales = quantize_groups(h) if fp8 == "w8a8" else (h, None)
    out = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)
    grid = (tile_experts.numel() * triton.cdiv(hidden, options["BLOCK_N"]),)
    _down_kernel[grid](a, w_down, out, sorted_pairs, tile_experts, weights.contiguous(), a_scales, down_scales, pairs,
                       num_experts, hidden, inter, a.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0),
                       *_scale_strides(a_scales, down_scales), BLOCK_M=rows, PRECISION=precision, FP8=fp8, **options)
    return out.view(tokens, top_k, hidden).sum(1)


def _scale_strides(a_scales: torch.Tensor | None, w_scales: torch.Tensor | None) -> tuple[int, int, int]:
    """The activation scales' row stride, the weight scales' expert and row strides (0 where there are none)."""
    return (a_scales.stride(0) if a_scales is not None else 0,
            *(w_scales.stride()[:2] if w_scales is not None else (0, 0)))


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref`, on Triton: `x [tokens, hidden]` -> `[tokens, hidden]`."""
    return _experts(x, w_gate_up, w_down, weights, ids, "none")


def fp8_fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                  down_scales: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`fp8_fused_moe_ref`, on Triton: fp8 experts with their block scales, W8A8 (GPUs with FP8 tensor cores)."""
    return _experts(x, w_gate_up, w_down, weights, ids, "w8a8", gate_up_scales, down_scales)


def dequant_fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                      down_scales: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref` on the fp8 experts' values, on Triton: each tile's weights expanded in registers (GPUs
    without FP8 tensor cores), the activations as they are."""
    return _experts(x, w_gate_up.view(torch.int8), w_down.view(torch.int8), weights, ids, "dequant", gate_up_scales,
                    down_scales)
