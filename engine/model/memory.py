"""How much memory the weights take and how much the KV pools may grow to."""

from __future__ import annotations

import os

import torch
from torch import nn


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weights_bytes(model: nn.Module) -> int:
    """Parameters and buffers, each storage counted once (tied embeddings are one tensor)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def kv_budget(kv_cache_memory: float, device: torch.device, reserved: int = 0) -> int:
    """`kv_cache_memory` in bytes: as given when above 1, else that fraction of the memory free now, less
    `reserved` (what the largest step allocates besides the pool)."""
    if kv_cache_memory > 1:
        return int(kv_cache_memory)
    return int(kv_cache_memory * free_memory(device)) - reserved


def split_budget(budget: int, layers: list[int], block_bytes: list[int], caps: list[int]) -> list[int]:
    """Most blocks of each pool: the budget shared in proportion to each pool's layers, then what a pool
    can never use (its `caps`: a sliding-window pool's blocks are bounded by the window) handed to the rest."""
    counts = [0] * len(layers)
    open_pools = list(range(len(layers)))
    while open_pools and budget > 0:
        share_layers = sum(layers[i] for i in open_pools)
        capped = [i for i in open_pools if caps[i] * block_bytes[i] <= budget * layers[i] // share_layers]
        if not capped:
            for i in open_pools:
                counts[i] = budget * layers[i] // share_layers // block_bytes[i]
            break
        for i in capped:
            counts[i] = caps[i]
            budget -= caps[i] * block_bytes[i]
            open_pools.remove(i)
    return counts
