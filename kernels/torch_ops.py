"""The engine's kernels in plain PyTorch, organised for speed: what runs wherever Triton does not (CPU).

Each function keeps the contract of its reference in `kernels` (which stay the readable ground truth): the
norms and RoPE use PyTorch's fused RMSNorm and write rotated halves in place rather than concatenating, so a
layer costs a few passes over its activations instead of a dozen small ones.

Attention follows `kernels.attention_ref` (layout, `cu_seqlens_q`, `seq_lens`, -1 table entries, windows).
Its speed comes from what the engine guarantees, that pools start zeroed and only ever hold finite K/V, so a
masked key needs no scrubbing (its weight is exactly zero); from gathering blocks as whole rows with
`index_select`; and from shaping every SDPA call so that PyTorch picks its fused kernel. Decodes attend in one
batched call (a sliding window gathers only the blocks it can see); prefill chunks go one sequence at a time.

A mixture-of-experts layer sorts its (token, expert) pairs by expert, as the Triton kernel does, and runs each
expert that any token chose as two matmuls over its own rows: a step costs what its chosen experts cost, and
never asks an expert no token chose for its tokens. FP8 experts are dequantized the same way, only the chosen
ones, each for its own matmuls (kernels.fp8_gemm.dequant_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_ref import visible
from kernels.fp8_gemm import dequant_linear
from kernels.fused_moe_ref import ExpertMLP, expert_mlp, fp8_expert_mlp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
               eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = (x if weight is None else rms_norm(x, weight, eps)).float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out.to(dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)  # broadcast over heads
    return _norm_rope(q, q_weight, cos, sin, eps), _norm_rope(k, k_weight, cos, sin, eps)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """`[..., length, kv_heads, head_dim]` from the blocks of `table` (-1 entries read block 0, masked later)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, table.clamp(min=0).reshape(-1).long())
    return rows.view(*table.shape[:-1], -1, *cache.shape[2:])[..., :length, :, :]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the 0 / -inf one SDPA adds to the scores: a step that reuses its mask in
    every layer converts it once (SDPA converts a boolean one in each call, a fifth of a short call's time)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence: `q [B, heads, D]` against `k`, `v` `[B, kv_heads, L, D]` (strided views are
    fine) under `mask [B, 1, 1, L]`."""
    return queries_attention(q[:, None], k, v, mask, scale)[:, 0]


def queries_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """`Q` queries per sequence (a decode's one, a row verifying drafts its token and its drafts, padded):
    `q [B, Q, heads, D]` against `k`, `v` `[B, kv_heads, L, D]` (strided views are fine) under `mask
    [B, 1, Q, L]`. The heads sharing a KV head and the queries become that head's "query length", so no K/V is
    repeated per head and SDPA stays on its fused kernel."""
    batch, queries, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    qg = q.view(batch, queries, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    if queries > 1:
        mask = mask.repeat(1, 1, group, 1)  # query (head h, position j) sits at h * Q + j
    out = F.scaled_dot_product_attention(qg.reshape(batch, kv_heads, group * queries, head_dim), k, v,
                                         attn_mask=mask, scale=scale)
    return out.view(batch, kv_heads, group, queries, head_dim).permute(0, 3, 1, 2, 4).reshape(q.shape)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, window: int = 0,
                    sinks: int = 0, stride: int = 0) -> torch.Tensor:
    if q.shape[0] == seq_lens.shape[0]:  # every sequence brings at least one token, so exactly one each
        return _decode(q, k_cache, v_cache, seq_lens, block_tables, scale, window, sinks, stride)
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1:]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    single = torch.nonzero(cu_seqlens_q.diff() == 1).flatten()
    if len(single) > 1:  # decodes beside longer rows (rows verifying drafts): one batched call for them
        at = cu_seqlens_q[single].long()
        out[at] = _decode(q[at], k_cache, v_cache, seq_lens[single], block_tables[single], scale, window, sinks,
                          stride)
    for b, length in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if n == 1 and len(single) > 1:
            continue
        table = block_tables[b, : -(-length // block_size)]
        # [kv_heads, group, L, D] views: K/V broadcast over their query heads, which keeps SDPA on its fused
        # kernel (its own GQA option falls back to materialising the scores on CPU)
        k = gather_blocks(k_cache, table, length).transpose(0, 1).unsqueeze(1).expand(kv_heads, group, length, head_dim)
        v = gather_blocks(v_cache, table, length).transpose(0, 1).unsqueeze(1).expand(kv_heads, group, length, head_dim)
        qb = q[cu[b]:cu[b + 1]].view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        if n == length and window == 0:  # the whole sequence is new: plain causal, no mask to build
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale)
        else:
            pos = torch.arange(length, device=q.device)
            mask = visible(pos[length - n:], pos, window, sinks, stride)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        out[cu[b]:cu[b + 1]] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, scale: float, window: int, sinks: int, stride: int) -> torch.Tensor:
    block_size = k_cache.shape[1]
    lens = seq_lens.long()
    longest = int(lens.max())
    first = 0
    if window > 0 and sinks == 0 and stride == 0:  # skip the blocks before every query's window
        first = max(0, int(lens.min()) - window) // block_size
    table = block_tables[:, first: -(-longest // block_size)]
    length = longest - first * block_size
    k = gather_blocks(k_cache, table, length).transpose(1, 2)  # [B, kv_heads, L, D], strided: no copy
    v = gather_blocks(v_cache, table, length).transpose(1, 2)
    k_pos = torch.arange(first * block_size, longest, device=q.device)
    mask = visible(lens - 1, k_pos, window, sinks, stride)  # [B, L]
    return decode_attention(q, k, v, mask[:, None, None, :], scale)


def _grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
             mlp: ExpertMLP) -> torch.Tensor:
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # the pairs by expert
    tokens = order // ids.shape[1]
    scale = weights.flatten()[order, None]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            # each expert's rows gathered, computed and added while they are in cache, in the reference's order
            end = start + count
            rows = tokens[start:end]
            out.index_add_(0, rows, mlp(expert, x.index_select(0, rows)).mul_(scale[start:end]))
            start = end
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    return _grouped(x, weights, ids, w_gate_up.shape[0], lambda e, rows: expert_mlp(rows, w_gate_up[e], w_down[e]))


def fp8_fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, gate_up_scales: torch.Tensor, w_down: torch.Tensor,
                  down_scales: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """FP8 experts, each chosen one's weights dequantized to `x`'s dtype for each of its matmuls."""
    return _grouped(x, weights, ids, w_gate_up.shape[0], lambda e, rows: fp8_expert_mlp(
        rows, w_gate_up[e], gate_up_scales[e], w_down[e], down_scales[e], dequant_linear))
