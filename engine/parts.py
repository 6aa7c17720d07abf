"""An `LLMEngine`'s parts, built from an `EngineConfig` in the order their memory needs.

The largest step's activations are measured and the piece graphs captured before the KV pool is sized, so a
budget given as a fraction of free memory leaves them room (the rule is `engine.model.memory_fit`). Each
optional part (prefix and host caches, piece and decode graphs, dense decode rows) is built by a function of
its own that says when it exists, and takes what it shares with another part as an argument.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager, BlockPool
from engine.core.host_cache import HostCache
from engine.core.kv_cache import KVCache, growth_plan
from engine.core.output_text import think_ids
from engine.core.prefix_cache import PrefixCache
from engine.core.scheduler import Scheduler
from engine.model.activation_memory import largest_step
from engine.model.cuda_graphs import DecodeGraphs, PieceGraphs
from engine.model.decoder import CausalLM
from engine.model.dense_decode import DenseDecodeKV
from engine.model.families import read_shape
from engine.model.kv_plan import KVPlan, lay_out_kv
from engine.model.loader import load_model, read_eos_ids
from engine.model.memory_fit import fit_kv, holds_back_activations
from engine.model.parallel import ALONE, Split
from engine.model.shape import rank_shape
from engine.model.step_executor import StepExecutor
from kernels.dispatch import Ops, select_ops


@dataclass
class EngineParts:
    tokenizer: PreTrainedTokenizerBase
    model: CausalLM
    max_model_len: int
    eos_ids: set[int]
    think_ids: tuple[int, int] | None  # a thinking model's `<think>` and `</think>`, if it has them
    kv_plan: KVPlan
    activation_bytes: int  # held back from a budget given as a fraction (CUDA only)
    blocks: BlockManager
    scheduler: Scheduler
    executor: StepExecutor


def build(config: EngineConfig, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
          split: Split = ALONE) -> EngineParts:
    """`weights` (checkpoint names and tensors) stands in for the folder's *.safetensors when given. `split`:
    this rank's part of a tensor-parallel engine, whose ranks all build in step (the steps that measure or
    capture run collectives) and agree on the KV pools' ceilings (each holds its shard of every block)."""
    device = torch.device(config.device)
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    shape = rank_shape(read_shape(config.model), split)
    cache_dtype = config.cache_dtype
    ops = select_ops(config.attention_backend, device, shape.head_dim, scaled_kv=cache_dtype.itemsize == 1)
    model = load_model(config.model, device, config.torch_dtype, ops, weights, split)
    max_model_len = min(config.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
    layout = lay_out_kv(shape, config, cache_dtype)
    held_back = holds_back_activations(config, device)
    activation_bytes = largest_step(model, ops, layout, config, cache_dtype) if held_back else 0
    pieces = piece_graphs(model, config, device)
    kv_plan = fit_kv(layout, config, max_model_len, device, activation_bytes, split)  # once the graphs hold theirs
    # each pool's K and V per layer are its segments: growth copies one at a time (engine.core.kv_cache)
    sizes = [growth_plan(min(config.initial_blocks, m), m, 2 * n)
             for n, m in zip(kv_plan.layers, kv_plan.max_blocks, strict=True)]
    caches = [KVCache(n, s[0], config.block_size, shape.num_kv_heads, shape.head_dim, cache_dtype, device)
              for n, s in zip(kv_plan.layers, sizes, strict=True)]
    prefix = prefix_cache(config, kv_plan, caches[0])
    pools = [BlockPool(c, s, prefix if i == 0 else None) for i, (c, s) in enumerate(zip(caches, sizes, strict=True))]
    blocks = BlockManager(pools, kv_plan.windows, config.block_size)
    graphs = decode_graphs(model, ops, caches, kv_plan, config, max_model_len, pieces)
    dense = dense_decode(ops, caches, kv_plan, config, max_model_len)
    executor = StepExecutor(model, caches, kv_plan.layer_slots, ops, config.block_size, graphs, pieces, dense)
    return EngineParts(tokenizer, model, max_model_len, read_eos_ids(config.model), think_ids(tokenizer), kv_plan,
                       activation_bytes, blocks, Scheduler(config, blocks), executor)


def piece_graphs(model: CausalLM, config: EngineConfig, device: torch.device) -> PieceGraphs | None:
    """On CUDA with `cuda_graphs`: every size captured now, before the pool is sized, so that free memory no
    longer counts what the graphs take."""
    if device.type != "cuda" or not config.cuda_graphs:
        return None
    pieces = PieceGraphs(model, config.max_num_batched_tokens)
    pieces.capture()
    return pieces


def prefix_cache(config: EngineConfig, kv_plan: KVPlan, cache: KVCache) -> PrefixCache | None:
    """For a model whose layers all keep every block (ring blocks are recycled mid-sequence), with its host
    tier when `host_cache_memory` holds a block of `cache`."""
    if not config.enable_prefix_cache or kv_plan.windows != [0]:
        return None
    host_blocks = config.host_cache_memory // cache.bytes_per_block
    return PrefixCache(HostCache(cache, host_blocks) if host_blocks > 0 else None)


def decode_graphs(model: CausalLM, ops: Ops, caches: list[KVCache], kv_plan: KVPlan, config: EngineConfig,
                  max_model_len: int, pieces: PieceGraphs | None) -> DecodeGraphs | None:
    """Whole decode steps, sharing the memory pool of `pieces`: only where those are captured, and on the
    Triton path with no windowed layer (its decode syncs with the host only to plan windowed tiles)."""
    if pieces is None or ops.backend != "triton" or not kv_plan.dense_only:
        return None
    per_seq = kv_plan.blocks_per_seq(config.block_size, max_model_len)
    return DecodeGraphs(model, ops, caches, kv_plan.layer_slots, config.max_num_seqs, per_seq, pieces)


def dense_decode(ops: Ops, caches: list[KVCache], kv_plan: KVPlan, config: EngineConfig,
                 max_model_len: int) -> DenseDecodeKV | None:
    """With `dense_decode`, on CPU under the fast torch ops, for a full-attention pool of plain (unscaled) K/V
    whose layers all attend densely: the rows stand in for those ops' decode attention over it."""
    if not config.dense_decode or ops.backend != "torch" or 0 not in kv_plan.windows:
        return None
    full = kv_plan.windows.index(0)
    cache = caches[full]
    if (cache.device.type != "cpu" or cache.scaled
            or any(s.policy.window for s in kv_plan.layer_slots if s.pool == full)):
        return None
    return DenseDecodeKV(cache, full, kv_plan.max_blocks[full] * kv_plan.block_bytes[full], max_model_len,
                         config.max_num_seqs)
