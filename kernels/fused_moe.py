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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    x, w, out, sorted_pairs, tile_experts, num_pairs, num_experts, N, K, stride_xm, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """`out[row] = silu(x[token] @ gate_e.T) * (x[token] @ up_e.T)` for the rows of one tile and N-columns."""
    expert, rm, pair, rn = _tile(sorted_pairs, tile_experts, N, BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    valid = pair < num_pairs
    x_rows = x + (pair // TOP_K).to(tl.int64)[:, None] * stride_xm
    result = swiglu_tile(x_rows, w + expert.to(tl.int64) * stride_we, valid, rn, N, K, stride_wn,
                         BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    # padding rows are written too (zeros): the down kernel reads whole tiles
    o_ptrs = out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=rn[None, :] < N)


@triton.jit
def _down_kernel(
    h, w, out, sorted_pairs, tile_experts, weights, num_pairs, num_experts, N, K, stride_hm, stride_we, stride_wn,
    stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """`out[pair] = weights[pair] * (h[row] @ down_e.T)` for the rows of one tile and N-columns."""
    expert, rm, pair, rn = _tile(sorted_pairs, tile_experts, N, BLOCK_M, BLOCK_N)
    if expert >= num_experts:
        return
    valid = pair < num_pairs
    rk = tl.arange(0, BLOCK_K)
    h_ptrs = h + rm.to(tl.int64)[:, None] * stride_hm + rk[None, :]
    w_ptrs = w + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(h_ptrs, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
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


def launch_options(rows: int, on_gpu: bool) -> dict:
    """Column and depth tiles, warps and pipeline stages for tiles of `rows` rows."""
    if not on_gpu:
        return _INTERPRETER_TILE
    return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3 if rows < 64 else 2}


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """`fused_moe_ref`, on Triton: `x [tokens, hidden]` -> `[tokens, hidden]`."""
    if x.stride(-1) != 1 or not w_gate_up.is_contiguous() or not w_down.is_contiguous():
        raise ValueError("x needs contiguous rows, and the expert weights must be contiguous")
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = ids.shape[1]
    pairs = tokens * top_k
    rows = tile_rows(pairs, num_experts)
    sorted_pairs, tile_experts = route(ids, num_experts, rows)
    options = launch_options(rows, x.is_cuda)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 callers want fp32 results, not tf32's
    h = torch.empty(sorted_pairs.numel(), inter, device=x.device, dtype=x.dtype)
    grid = (tile_experts.numel() * triton.cdiv(inter, options["BLOCK_N"]),)
    _gate_up_kernel[grid](x, w_gate_up, h, sorted_pairs, tile_experts, pairs, num_experts, inter, hidden, x.stride(0),
                          w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), TOP_K=top_k, BLOCK_M=rows,
                          PRECISION=precision, **options)
    out = torch.empty(pairs, hidden, device=x.device, dtype=x.dtype)
    grid = (tile_experts.numel() * triton.cdiv(hidden, options["BLOCK_N"]),)
    _down_kernel[grid](h, w_down, out, sorted_pairs, tile_experts, weights.contiguous(), pairs, num_experts, hidden,
                       inter, h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), BLOCK_M=rows,
                       PRECISION=precision, **options)
    return out.view(tokens, top_k, hidden).sum(1)
