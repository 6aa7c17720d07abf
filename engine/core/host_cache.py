"""The host-memory tier under the prefix cache: blocks evicted from the KV pool, by entry, LRU-bounded. Like the
pool's index it is keyed by the whole entry (`engine.core.block_key.BlockKey`), so it serves a block only to
requests of the salt that computed it.

Copies run on a side stream on CUDA (pinned buffers, so they are truly asynchronous) and the compute stream
waits for them before its next kernel, so a copy overlaps whatever step is still running on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.core.block_key import BlockKey
from engine.core.kv_cache import KVCache


class HostCache:
    def __init__(self, cache: KVCache, max_blocks: int) -> None:
        self.cache = cache
        self.max_blocks = max_blocks
        self.entries: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()  # least recent first
        self.stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        self.num_evictions = 0
        # on rank 0 of a tensor-parallel engine: every put and load, in order, for the other ranks to repeat on
        # their shards of the pool (engine.tensor_parallel)
        self.journal: list[tuple[str, BlockKey, int]] | None = None

    def put(self, entry: BlockKey, block: int) -> None:
        """Keep a copy of pool block `block`, which holds `entry`'s tokens."""
        if self.journal is not None:
            self.journal.append(("put", entry, block))
        if entry in self.entries:
            self.entries.move_to_end(entry)
            return
        if len(self.entries) < self.max_blocks:
            # allocated as needed, not up front: most runs never fill the tier
            buffer = torch.empty(self.cache.block_shape(), dtype=self.cache.dtype, pin_memory=self.stream is not None)
        else:
            _, buffer = self.entries.popitem(last=False)
            self.num_evictions += 1
        with self._copying():
            self.cache.read_block(block, buffer)
        self.entries[entry] = buffer

    def contains(self, entry: BlockKey) -> bool:
        return entry in self.entries

    def load(self, entry: BlockKey, block: int) -> None:
        """Copy `entry` (which `contains`) into pool block `block`."""
        if self.journal is not None:
            self.journal.append(("load", entry, block))
        self.entries.move_to_end(entry)
        with self._copying():
            self.cache.write_block(block, self.entries[entry])

    @contextmanager
    def _copying(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        # after the work already queued on the compute stream, which waits for the copies in turn
        compute = torch.cuda.current_stream(self.cache.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)
