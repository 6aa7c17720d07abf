"""The KV pool grows towards its budget without ever holding more than the budget, contents kept."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from engine.core.block_manager import BlockPool
from engine.core.kv_cache import KVCache, growth_plan


class Allocations:
    """Bytes held by the tensors `torch.zeros` made (while they live), and the most ever held at once."""

    def __init__(self) -> None:
        self.live: list[weakref.ref] = []
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        self.live.append(weakref.ref(tensor))
        # memory is only ever taken at an allocation, so the peak is seen at one
        self.peak = max(self.peak, sum(t.nbytes for r in self.live if (t := r()) is not None))
        return tensor


@pytest.mark.parametrize("layers", [1, 2, 28])
@pytest.mark.parametrize("initial", [1, 7, 60, 95])
def test_pool_growth_stays_within_its_budget_and_keeps_every_block(monkeypatch, layers, initial):
    ceiling = 100
    allocations = Allocations()
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocations.track(zeros(*a, **k)))
    sizes = growth_plan(initial, ceiling, 2 * layers)
    cache = KVCache(layers, sizes[0], 2, 1, 4, torch.float32, torch.device("cpu"))
    pool = BlockPool(cache, sizes)
    held = {}
    while pool.can_allocate(1):
        block = pool.allocate()
        held[block] = float(len(held) + 1)
        for i in range(layers):  # no view of a segment outlives the statement, as in the engine
            cache.layer(i)[0][block], cache.layer(i)[1][block] = held[block], -held[block]
    assert cache.num_blocks == len(held) == sizes[-1] >= ceiling - math.ceil(ceiling / (4 * layers))
    assert allocations.peak <= ceiling * cache.bytes_per_block
    for block, value in held.items():
        for i in range(layers):
            k, v = cache.layer(i)
            assert (k[block] == value).all() and (v[block] == -value).all()


def test_growth_is_geometric_up_to_half_the_budget_then_one_step_to_what_the_copy_allows():
    assert growth_plan(10, 1000, 56) == [10, 15, 23, 35, 53, 80, 120, 180, 270, 405, 992]
    assert growth_plan(10, 1000, 2) == [10, 15, 23, 35, 53, 80, 120, 180, 270, 405, 797]
    assert growth_plan(600, 1000, 56) == [1000]  # already past half: the whole budget from the start


def test_a_fractional_budget_leaves_the_largest_steps_activations_free(monkeypatch):
    from engine.model import memory_fit

    monkeypatch.setattr(memory_fit, "free_memory", lambda device: 1000)
    assert memory_fit.kv_budget(0.5, torch.device("cpu"), reserved=100) == 400
    assert memory_fit.kv_budget(4096, torch.device("cpu"), reserved=100) == 4096  # bytes given: taken as they are


@pytest.mark.parametrize("preset", ["tiny", "tiny-swa"])
def test_the_profiling_step_runs_the_largest_batch_through_every_pool(tiny_models, preset):
    from engine.model.activation_memory import largest_step
    from tests.engine_helpers import make_engine

    engine = make_engine(tiny_models[preset], max_num_batched_tokens=300, prefill_chunk_size=128, max_num_seqs=64)
    # on CPU nothing is measured, but the same forward runs: chunks, tables and slots for every pool
    assert largest_step(engine.model, engine.executor.ops, engine.kv_plan, engine.config, engine.config.cache_dtype) == 0
    assert engine.memory_report()["activation_bytes"] == 0
