"""PyTorch reference for attention over the paged KV cache: the ground truth the Triton kernels are tested
against, and the path the engine runs on CPU.

Layout (shared by every attention kernel):
- `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`, one pair per layer.
- `slot_mapping`: `[num_tokens]` int, `block * block_size + offset` where each new token's K/V goes; -1 skips.
- `q`: `[num_tokens, num_heads, head_dim]`, the new tokens of all sequences packed back to back.
- `cu_seqlens_q`: `[batch + 1]` int, where each sequence's new tokens start in `q`.
- `seq_lens`: `[batch]` int, tokens in the cache per sequence *including* the new ones; the new tokens are
  the last ones, so query `i` of a sequence with `n` new tokens sits at position `seq_len - n + i`.
- `block_tables`: `[batch, max_blocks]` int, logical block -> physical block. Entries for blocks the pattern
  never reads (outside the window and the sinks) may be -1: a ring-recycled sliding-window layer has none.
- `window`: 0 for full causal attention, else each query sees keys at `pos - window < key_pos <= pos`;
  `sinks`: keys `< sinks` are always visible as well (StreamingLLM-style attention sinks);
  `stride`: with a window, every `stride`-th key (positions `stride - 1`, `2 * stride - 1`, ...) is visible as
  well (local + strided attention).
- `k_scale`, `v_scale`: `[num_kv_heads]` float32, set when the cache holds fp8: a stored value times its head's
  scale is the real K/V.
"""

from __future__ import annotations

import torch


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """`x [..., kv_heads, head_dim]` as stored in a cache of `cache_dtype`, divided by its head's scale."""
    if scale is None:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max  # fp8 e4m3 has no infinity: out-of-range values would become NaN
    return (x.float() / scale.view(-1, 1)).clamp(-limit, limit).to(cache_dtype)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = quantize_kv(v[keep], v_cache.dtype, v_scale)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sinks: int, stride: int = 0) -> torch.Tensor:
    """Boolean mask `[..., q, k]`: which keys each query may attend to."""
    q_pos, k_pos = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    mask = k_pos <= q_pos
    if window > 0:
        keep = (q_pos - k_pos < window) | (k_pos < sinks)
        if stride > 0:
            keep |= k_pos % stride == stride - 1
        mask &= keep
    return mask


def _gather(
    cache: torch.Tensor, table: torch.Tensor, length: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """`[..., length, kv_heads, head_dim]` float32 from the blocks of `table`, dequantized when the cache has
    scales. -1 entries read as zeros: their keys are masked, and a masked key must not bring stale NaNs."""
    blocks = cache[table.clamp(min=0).long()].float()  # [..., nblocks, block_size, H, D]
    blocks = blocks.masked_fill((table < 0)[..., None, None, None], 0.0)
    gathered = blocks.flatten(-4, -3)[..., :length, :, :]
    return gathered if scale is None else gathered * scale.view(-1, 1)


def paged_attention_ref(
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
) -> torch.Tensor:
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    block_size = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    batch = len(lens)
    if cu[-1] == batch:  # decode: one query per sequence, done for the whole batch at once
        longest = max(lens)
        nblocks = -(-longest // block_size)
        k = _gather(k_cache, block_tables[:, :nblocks], longest, k_scale)  # [B, L, Hkv, D]
        v = _gather(v_cache, block_tables[:, :nblocks], longest, v_scale)
        qg = q.float().view(batch, kv_heads, group, -1)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
        k_pos = torch.arange(longest, device=q.device)
        q_pos = seq_lens.to(q.device).long() - 1
        mask = visible(q_pos, k_pos, window, sinks, stride)  # [B, 1, L]
        scores.masked_fill_(~mask.view(batch, 1, 1, longest), float("-inf"))
        v = v.masked_fill(~mask.view(batch, longest, 1, 1), 0.0)  # slots past a shorter sequence: stale bytes
        out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
        return out.reshape(q.shape).to(q.dtype)
    out = torch.empty_like(q)
    for b in range(batch):
        n, length = cu[b + 1] - cu[b], lens[b]
        nblocks = -(-length // block_size)
        k = _gather(k_cache, block_tables[b, :nblocks], length, k_scale)  # [L, Hkv, D]
        v = _gather(v_cache, block_tables[b, :nblocks], length, v_scale)
        qb = q[cu[b]:cu[b + 1]].float().view(n, kv_heads, group, -1)
        scores = torch.einsum("qhgd,lhd->hgql", qb, k) * scale
        q_pos = torch.arange(length - n, length, device=q.device)
        mask = visible(q_pos, torch.arange(length, device=q.device), window, sinks, stride)
        scores.masked_fill_(~mask, float("-inf"))
        out[cu[b]:cu[b + 1]] = torch.einsum("hgql,lhd->qhgd", scores.softmax(-1), v).reshape(n, num_heads, -1).to(q.dtype)
    return out
