"""How many KV blocks fit: the one rule that sizes the KV pools.

The budget (`kv_cache_memory`) is bytes when above 1, else that fraction of the memory free once the weights
are loaded. On CUDA a fractional budget leaves the largest step room: what a forward over it allocates is
measured (`engine.model.activation_memory`) and held back, and the piece graphs are captured before the budget
is read, so that free memory no longer counts them (`engine.builder` keeps that order). The budget is shared
among the pools in proportion to their layers, after each sliding-window pool took what its rings can ever
use; a pool never needs more than `max_num_seqs` sequences of `max_model_len` tokens, and must hold two
blocks at least. Tensor-parallel ranks each hold their shard of every block, so all take the smallest ceiling
of any rank.
"""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.model.kv_plan import KVLayout, KVPlan
from engine.model.parallel import ALONE, Split, agree_min


def holds_back_activations(config: EngineConfig, device: torch.device) -> bool:
    """The budget is a fraction of free memory on CUDA, where the allocator can tell what a step takes."""
    return device.type == "cuda" and config.kv_cache_memory <= 1


def fit_kv(layout: KVLayout, config: EngineConfig, max_model_len: int, device: torch.device, reserved: int = 0,
           split: Split = ALONE) -> KVPlan:
    """Each pool's ceiling in blocks. `reserved`: bytes of free memory a budget given as a fraction leaves to
    the largest step's activations."""
    per_seq = layout.blocks_per_seq(config.block_size, max_model_len)
    budget = kv_budget(config.kv_cache_memory, device, reserved)
    max_blocks = split_budget(budget, layout.layers, layout.block_bytes, [b * config.max_num_seqs for b in per_seq])
    if min(max_blocks) < 2:
        raise ValueError(f"a KV budget of {budget} bytes does not hold even two blocks per pool")
    return KVPlan.within(layout, budget, agree_min(max_blocks, device, split))


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
