"""What the largest step needs besides the weights and the KV pool, measured before the pool is sized.

A forward over `max_num_batched_tokens` tokens (prefill chunks of `prefill_chunk_size`, the costliest mix
of a step) allocates activations, attention scratch and the logits of `max_num_seqs` rows sorted for sampling.
On CUDA the peak of the caching allocator over one such forward, with random inputs and a throwaway KV cache
of just the blocks it needs, is held back from the memory the pool may take, so a budget given as a fraction
of free memory cannot run the device out of memory at the first big step.
"""

from __future__ import annotations

import math

import torch

from engine.config import EngineConfig
from engine.core.kv_cache import KVCache
from engine.model.attention_batch import AttentionBatch, BatchPart
from engine.model.decoder import CausalLM
from engine.model.kv_plan import KVLayout
from kernels.dispatch import Ops


def largest_step(model: CausalLM, ops: Ops, layout: KVLayout, config: EngineConfig,
                 cache_dtype: torch.dtype) -> int:
    """Bytes a forward over the largest step allocates at its peak beyond its inputs and KV blocks (0 unless
    on CUDA, where the allocator can tell)."""
    device = next(model.parameters()).device
    measured = device.type == "cuda"
    shape, size = model.shape, config.block_size
    total = config.max_num_batched_tokens
    counts = [min(config.prefill_chunk_size, total - start) for start in range(0, total, config.prefill_chunk_size)]
    widths = [math.ceil(n / size) for n in counts]
    caches = [KVCache(n, sum(widths) + 1, size, shape.num_kv_heads, shape.head_dim, cache_dtype, device)
              for n in layout.layers]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    tables = torch.full((len(counts), max(widths)), -1, dtype=torch.int32)
    for row, (start, width) in enumerate(zip(starts, widths, strict=True)):
        tables[row, :width] = torch.arange(start, start + width)
    counts_t = torch.tensor(counts)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), counts_t.cumsum(0)])
    row = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    positions = torch.arange(total) - cu_seqlens[row]
    slots = (tables[row, positions // size].long() * size + positions % size).to(device)
    ids = torch.randint(0, shape.vocab_size, (total,), device=device)
    part = BatchPart(0, total, cu_seqlens.to(device), counts_t.to(device), [tables.to(device)] * len(caches))
    attn = AttentionBatch(ops, caches, layout.layer_slots, [slots] * len(caches), [part])
    if measured:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, positions.to(device), attn)
        rows = torch.arange(min(config.max_num_seqs, total), device=device)
        logits = model.compute_logits(hidden[rows])
        logits.sort(dim=-1, descending=True)  # what sampling with top-p costs at most
    if not measured:
        return 0
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, logits, attn, caches
    torch.cuda.empty_cache()
    return peak
