"""Triton attention over the paged KV cache, with the signature and results of `attention_ref`.

- Decode (one new token per sequence): flash-decoding. Each program takes one sequence, one KV head and one
  slice of the key tiles, serving all query heads of that KV head at once (GQA), and leaves a partial output
  with its log-sum-exp; a second kernel merges the slices.
- Prefill/extend (several new tokens per sequence, packed): one program per tile of new tokens and query head,
  attending to the cached prefix and causally to the new tokens.

Both walk key tiles of `BLOCK_N` tokens, reading each token's slot through the block table, so tiles need not
line up with cache blocks. With a window the tiles come from the policy's CSR (`kernels.sparse`), so work and
KV reads scale with the kept tiles; the exact token mask is applied inside each tile. fp8 caches are read
directly: a KV head's scale folds into the softmax scale (K) and the output (V).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton
import triton.language as tl

from kernels.sparse import AttentionPolicy, BlockCSR, block_csr

T = TypeVar("T")

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are pre-multiplied by log2(e)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, tile, seq_len, table_row, k_cache, v_cache, kv_head,
    stride_kb, stride_kt, stride_kh, qk_scale, window, sinks, stride,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
):
    """Online-softmax update of `acc [M, D]`, running max `m_i` and sum `l_i` (base 2) with one key tile."""
    k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seq = k_pos < seq_len
    block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=in_seq, other=-1)
    valid = in_seq & (block >= 0)  # -1 marks a block the pattern never reads: its keys are masked anyway
    offs = block.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    offs = offs[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    # Masked loads give 0, never stale cache bytes, so a 0 probability can't meet a NaN in V.
    k = tl.load(k_cache + offs, mask=valid[:, None], other=0.0).to(q.dtype)
    v = tl.load(v_cache + offs, mask=valid[:, None], other=0.0).to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    see = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if WINDOWED:
        near = (q_pos[:, None] - k_pos[None, :] < window) | (k_pos[None, :] < sinks)
        if stride > 0:
            near |= (k_pos[None, :] % stride) == stride - 1
        see &= near
    s = tl.where(see, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    q, k_cache, v_cache, seq_lens, block_tables, row_ptr, col_idx, k_scale, v_scale, part_out, part_lse,
    stride_qt, stride_qh, stride_bt, stride_kb, stride_kt, stride_kh,
    qk_scale, window, sinks, stride, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPARSE: tl.constexpr, WINDOWED: tl.constexpr, SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    if SPARSE:
        first = tl.load(row_ptr + seq)
        count = tl.load(row_ptr + seq + 1) - first
    else:
        first = 0
        count = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(count, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, count)

    if SCALED:
        qk_scale *= tl.load(k_scale + kv_head)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    # Heads are padded to at least 16 rows because tl.dot needs them; the padding rows read nothing.
    q_tile = tl.load(q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + seq_len - 1
    table_row = block_tables + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for i in range(lo, hi):
        tile = tl.load(col_idx + first + i) if SPARSE else i
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q_tile, q_pos, tile, seq_len, table_row, k_cache, v_cache, kv_head,
            stride_kb, stride_kt, stride_kh, qk_scale, window, sinks, stride,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, WINDOWED, PRECISION,
        )

    empty = l_i == 0.0  # a split with no tiles: its log-sum-exp of -inf gives it no weight in the merge
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SCALED:
        out *= tl.load(v_scale + kv_head)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = (seq * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # [batch, heads, splits]
    live = g < GROUP
    tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], out, mask=live[:, None])
    tl.store(part_lse + part, lse, mask=live)


@triton.jit
def _merge_kernel(part_out, part_lse, out, stride_ot, stride_oh, num_splits,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    part = (seq * tl.num_programs(1) + head) * num_splits + s
    lse = tl.load(part_lse + part, mask=s < num_splits, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_out + part[:, None] * HEAD_DIM + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out + seq * stride_ot + head * stride_oh + d, merged.to(out.dtype.element_ty))


@triton.jit
def _extend_kernel(
    q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, row_seq, row_tok, row_cnt,
    row_ptr, col_idx, k_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh,
    qk_scale, window, sinks, stride,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPARSE: tl.constexpr, WINDOWED: tl.constexpr, SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    count = tl.load(row_cnt + row)
    if count == 0:  # the grid is sized for the worst case; spare rows have no queries
        return
    kv_head = head // GROUP
    seq = tl.load(row_seq + row)
    tok0 = tl.load(row_tok + row)
    q_start = tl.load(cu_seqlens_q + seq)
    seq_len = tl.load(seq_lens + seq)
    new_tokens = tl.load(cu_seqlens_q + seq + 1) - q_start

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    live = m < count
    tok = (tok0 + m).to(tl.int64)
    q_pos = seq_len - new_tokens + (tok0 - q_start) + m
    q_tile = tl.load(q + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=live[:, None], other=0.0)
    if SCALED:
        qk_scale *= tl.load(k_scale + kv_head)
    if SPARSE:
        first = tl.load(row_ptr + row)
        tiles = tl.load(row_ptr + row + 1) - first
    else:
        first = 0
        tiles = tl.cdiv(seq_len - new_tokens + (tok0 - q_start) + count, BLOCK_N)  # up to the last query
    table_row = block_tables + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(0, tiles):
        tile = tl.load(col_idx + first + i) if SPARSE else i
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q_tile, q_pos, tile, seq_len, table_row, k_cache, v_cache, kv_head,
            stride_kb, stride_kt, stride_kh, qk_scale, window, sinks, stride,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, WINDOWED, PRECISION,
        )

    result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SCALED:
        result *= tl.load(v_scale + kv_head)
    o_ptrs = out + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=live[:, None])


@dataclass(frozen=True)
class _Tiling:
    block_m: int  # new tokens per extend program
    block_n: int  # keys per tile
    min_split_tiles: int  # fewest key tiles worth a decode split of their own
    processors: int  # multiprocessors to keep busy


def _tiling(q: torch.Tensor, batch: int) -> _Tiling:
    """On CPU the interpreter runs the kernels: small tiles keep it fast and make short test sequences span
    many tiles and splits. On GPU, short extends (mostly decode-like rows) take the smaller query tile."""
    if not q.is_cuda:
        return _Tiling(block_m=16, block_n=16, min_split_tiles=1, processors=4)
    block_m = 128 if q.shape[0] >= 128 * batch else 64
    return _Tiling(block_m=block_m, block_n=64, min_split_tiles=4, processors=_processors(q.device))


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_splits(batch: int, kv_heads: int, max_tiles: int, tiling: _Tiling) -> int:
    """Enough slices of the key tiles for about four programs per multiprocessor, none under `min_split_tiles`."""
    wanted = triton.cdiv(4 * tiling.processors, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tiles, tiling.min_split_tiles), 64))


def _tuned(kernel: triton.JITFunction, configs: list[tuple[int, int]]) -> triton.runtime.Autotuner:
    """`kernel` autotuned over (num_warps, num_stages), once per head size and group (dtypes key it too)."""
    return triton.autotune(
        configs=[triton.Config({}, num_warps=warps, num_stages=stages) for warps, stages in configs],
        key=["HEAD_DIM", "GROUP", "BLOCK_N"],
    )(kernel)


_decode_tuned = _tuned(_decode_kernel, [(4, 2), (4, 3), (8, 2), (8, 3)])
_extend_tuned = _tuned(_extend_kernel, [(4, 2), (8, 2), (8, 3)])


def query_tiles(cu_seqlens_q: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, ...]:
    """Split each sequence's new tokens into rows of at most `block_m`: per row its sequence, first token and
    token count (0 past the end). Runs on the device without a host sync; `num_rows` must bound the rows."""
    cu = cu_seqlens_q.long()
    tiles = (cu[1:] - cu[:-1] + block_m - 1) // block_m
    first_row = torch.cumsum(tiles, 0) - tiles
    rows = torch.arange(num_rows, device=cu.device)
    seq = torch.searchsorted(first_row, rows, right=True) - 1
    tok = cu[seq] + (rows - first_row[seq]) * block_m
    count = (cu[seq + 1] - tok).clamp(0, block_m)
    return seq.to(torch.int32), tok.to(torch.int32), count.to(torch.int32)


def _precision(dtype: torch.dtype) -> str:
    # fp32 callers want fp32 results: the default tf32 would cost three decimal digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share a layout with contiguous head_dim, as must q")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: int = 0,
    stride: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    layouts: dict | None = None,
) -> torch.Tensor:
    """`attention_ref.paged_attention_ref`, on Triton. `layouts`, when given, is a dict that lives as long as
    these queries and key lengths do (one step's part, the same at every layer): the query tiles and kept key
    tiles the first call works out (device work and a host sync each) are kept there for the next calls."""
    _check(q, k_cache, v_cache)
    policy = AttentionPolicy(window, sinks, stride)
    if q.shape[0] == seq_lens.shape[0]:  # every sequence brings at least one token, so exactly one each
        return _decode(q, k_cache, v_cache, seq_lens, block_tables, scale, policy, k_scale, v_scale, layouts)
    return _extend(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, policy, k_scale, v_scale,
                   layouts)


def _kept(layouts: dict | None, key: tuple, build: Callable[[], T]) -> T:
    """`build()`, or what it gave for `key` in `layouts` before."""
    if layouts is None:
        return build()
    if key not in layouts:
        layouts[key] = build()
    return layouts[key]


def _cache_args(k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, ...]:
    return block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _policy_args(policy: AttentionPolicy) -> tuple[int, int, int]:
    return policy.window, policy.sinks, policy.stride


def _csr(
    policy: AttentionPolicy, q_first: torch.Tensor, q_last: torch.Tensor, max_keys: int, block_n: int
) -> BlockCSR | None:
    """The kept key tiles when a window makes the pattern sparse; dense attention walks all causal tiles."""
    if policy.window == 0:
        return None
    return block_csr(policy, q_first, q_last, triton.cdiv(max_keys, block_n), block_n)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    policy: AttentionPolicy,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layouts: dict | None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    tiling = _tiling(q, batch)
    max_keys = block_tables.shape[1] * block_size
    csr = _kept(layouts, ("decode", policy, max_keys, tiling.block_n),
                lambda: _csr(policy, seq_lens - 1, seq_lens - 1, max_keys, tiling.block_n))
    max_tiles = csr.max_row if csr else triton.cdiv(max_keys, tiling.block_n)
    splits = _decode_splits(batch, kv_heads, max_tiles, tiling)

    part_out = torch.empty(batch, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(batch, num_heads, splits, device=q.device, dtype=torch.float32)
    scaled = k_scale is not None
    kernel = _decode_tuned if q.is_cuda else _decode_kernel
    kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, seq_lens, block_tables,
        csr.row_ptr if csr else seq_lens, csr.col_idx if csr else seq_lens,
        k_scale if scaled else q, v_scale if scaled else q, part_out, part_lse,
        q.stride(0), q.stride(1), *_cache_args(k_cache, block_tables),
        scale * LOG2E, *_policy_args(policy), splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, BLOCK_N=tiling.block_n,
        HEAD_DIM=head_dim, SPARSE=csr is not None, WINDOWED=policy.window > 0, SCALED=scaled,
        PRECISION=_precision(q.dtype),
    )
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    _merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), splits,
        SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
    )
    return out


def _extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    policy: AttentionPolicy,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    layouts: dict | None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    tiling = _tiling(q, batch)
    block_m, block_n = tiling.block_m, tiling.block_n
    num_rows = num_tokens // block_m + batch  # each sequence adds at most one partial row
    max_keys = block_tables.shape[1] * block_size

    def layout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BlockCSR | None]:
        row_seq, row_tok, row_cnt = query_tiles(cu_seqlens_q, block_m, num_rows)
        seq = row_seq.long()
        q_first = (seq_lens - (cu_seqlens_q[1:] - cu_seqlens_q[:-1]))[seq] + row_tok - cu_seqlens_q[seq]
        return row_seq, row_tok, row_cnt, _csr(policy, q_first, q_first + row_cnt - 1, max_keys, block_n)

    row_seq, row_tok, row_cnt, csr = _kept(layouts, ("extend", policy, max_keys, block_m, block_n), layout)

    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    scaled = k_scale is not None
    kernel = _extend_tuned if q.is_cuda else _extend_kernel
    kernel[(num_rows, num_heads)](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, row_seq, row_tok, row_cnt,
        csr.row_ptr if csr else row_cnt, csr.col_idx if csr else row_cnt,
        k_scale if scaled else q, v_scale if scaled else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_args(k_cache, block_tables),
        scale * LOG2E, *_policy_args(policy),
        GROUP=num_heads // kv_heads, BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HEAD_DIM=head_dim, SPARSE=csr is not None, WINDOWED=policy.window > 0, SCALED=scaled,
        PRECISION=_precision(q.dtype),
    )
    return out
