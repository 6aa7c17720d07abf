"""Full KV blocks of one pool indexed by content, so later sequences with the same prefix skip recomputing it.

A block's key hashes its tokens together with its parent's key, and a first block's parent is its request's
cache salt (`engine.core.block_key.salt_root`), so equal keys mean equal prefixes up to and including the block
under one salt. Blocks are indexed by their whole entry (key, parent key, tokens and salt), compared on every
hit: a hash collision can only cost a miss, and a block is never found by a request of another salt, nor kept
out of the index by one. Cached blocks stay in the pool after their last reference is gone; they are parked in
an LRU list and only evicted when the pool needs room, and then spilled to the host tier if any.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.block_key import BlockKey
from engine.core.host_cache import HostCache


class PrefixCache:
    def __init__(self, host: HostCache | None) -> None:
        self.host = host
        self.blocks: dict[BlockKey, int] = {}  # entry -> block
        self.entries: dict[int, BlockKey] = {}  # block -> its entry
        self.parked: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recent first
        self.prefetched: set[int] = set()  # blocks copied back from the host and not used since
        self.num_prefetched = 0
        self.num_prefetch_hits = 0
        self.num_evictions = 0

    def lookup(self, entry: BlockKey) -> int | None:
        return self.blocks.get(entry)

    def insert(self, block: int, entry: BlockKey, prefetched: bool = False) -> bool:
        """Index `block` under `entry`; False when that content is already cached in another block."""
        if entry in self.blocks or block in self.entries:
            return False
        self.blocks[entry] = block
        self.entries[block] = entry
        if prefetched:
            self.prefetched.add(block)
            self.num_prefetched += 1
        return True

    def holds(self, block: int) -> bool:
        return block in self.entries

    def park(self, block: int) -> None:
        self.parked[block] = None

    def take(self, block: int) -> bool:
        """A sequence starts using `block`; True when the host tier had brought it back for that."""
        self.parked.pop(block, None)
        if block in self.prefetched:
            self.prefetched.discard(block)
            self.num_prefetch_hits += 1
            return True
        return False

    def touch(self, block: int) -> None:
        if block in self.parked:
            self.parked.move_to_end(block)

    def evict(self) -> int:
        """Forget the least recently used unreferenced block, spilling it to the host tier; returns it."""
        block, _ = self.parked.popitem(last=False)
        entry = self.entries.pop(block)
        del self.blocks[entry]
        self.prefetched.discard(block)
        self.num_evictions += 1
        if self.host is not None:
            self.host.put(entry, block)
        return block
