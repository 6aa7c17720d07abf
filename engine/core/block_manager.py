"""Which KV blocks each sequence owns.

One pool per attention kind: full-attention layers keep every block of a sequence; sliding-window layers use
their table as a ring, handing back blocks wholly outside the window (such entries become -1, which kernels
never read). Tables hold logical indices (block `i` holds positions `i * block_size ...`), all of a
sequence's tables one length. Blocks are reference-counted, so with a `PrefixCache` (models without
sliding-window layers) full blocks are indexed by content, shared by sequences with the same prefix and kept
after their last reference until the pool needs room. `TableRows` mirrors the tables as rows of one host
array per pool, so that a step's tables are gathered, not rebuilt from lists.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.core.block_key import extend_keys
from engine.core.kv_cache import KVCache
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence


class BlockPool:
    """Free list and reference counts of one KV cache; it grows through `sizes` (its `growth_plan`, the first
    its size now) up to `max_blocks`, the last, and only then evicts unreferenced cached blocks."""

    def __init__(self, cache: KVCache, sizes: list[int], prefix: PrefixCache | None = None) -> None:
        self.cache = cache
        self.sizes = sizes
        self.max_blocks = sizes[-1]
        self.prefix = prefix
        self.ref_counts = [0] * cache.num_blocks
        self.free: deque[int] = deque(range(cache.num_blocks))

    @property
    def capacity(self) -> int:
        return len(self.ref_counts)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their contents."""
        return len(self.prefix.parked) if self.prefix is not None else 0

    @property
    def num_used(self) -> int:
        return self.capacity - len(self.free) - self.num_cached

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free) + self.max_blocks - self.capacity + self.num_cached

    def allocate(self) -> int:
        if not self.free and self.capacity < self.max_blocks:
            self._grow()
        block = self.free.popleft() if self.free else self.prefix.evict()
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> bool:
        """One more reference to cached `block`; True when the host tier had brought it back for this use."""
        self.ref_counts[block] += 1
        return self.prefix.take(block)

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return
        if self.prefix is not None and self.prefix.holds(block):
            self.prefix.park(block)
        else:
            self.free.append(block)

    def _grow(self) -> None:
        old = self.capacity
        new = next(size for size in self.sizes if size > old)
        self.cache.resize(new)
        self.ref_counts.extend([0] * (new - old))
        self.free.extend(range(old, new))


class TableRows:
    """The block tables of the sequences holding blocks, as rows of one int32 array per pool, -1 where no block
    is (past a table's end, and recycled ring entries). A sequence takes a row (`Sequence.table_row`) with its
    first block and gives it back with its last; both grow (doubling) when short."""

    def __init__(self, num_pools: int, rows: int = 16, width: int = 16) -> None:
        self.arrays = [np.full((rows, width), -1, dtype=np.int32) for _ in range(num_pools)]
        self.free_rows = list(range(rows - 1, -1, -1))  # popped from the end: low rows first

    def write(self, seq: Sequence, pool: int, start: int, blocks: list[int]) -> None:
        """`blocks` at `seq`'s table entries `start ...` of `pool`."""
        if seq.table_row < 0:
            if not self.free_rows:
                self._grow(rows=2 * self.arrays[0].shape[0])
            seq.table_row = self.free_rows.pop()
        end = start + len(blocks)
        if end > self.arrays[0].shape[1]:
            self._grow(width=max(end, 2 * self.arrays[0].shape[1]))
        self.arrays[pool][seq.table_row, start:end] = blocks

    def clear(self, seq: Sequence, pool: int, index: int) -> None:
        self.arrays[pool][seq.table_row, index] = -1

    def release(self, seq: Sequence, length: int) -> None:
        """`seq`'s row back, its first `length` entries (all it wrote) reset."""
        if seq.table_row < 0:
            return
        for array in self.arrays:
            array[seq.table_row, :length] = -1
        self.free_rows.append(seq.table_row)
        seq.table_row = -1

    def gather(self, rows: np.ndarray, width: int) -> list[np.ndarray]:
        """Per pool, the first `width` entries of `rows` (sequences' `table_row`): `[len(rows), width]`."""
        return [array[rows, :width] for array in self.arrays]

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        old_rows, old_width = self.arrays[0].shape
        rows, width = max(rows, old_rows), max(width, old_width)
        for i, array in enumerate(self.arrays):
            grown = np.full((rows, width), -1, dtype=np.int32)
            grown[:old_rows, :old_width] = array
            self.arrays[i] = grown
        self.free_rows[:0] = range(rows - 1, old_rows - 1, -1)


class BlockManager:
    def __init__(self, pools: list[BlockPool], windows: list[int], block_size: int) -> None:
        self.pools = pools
        self.windows = windows  # per pool: 0 for full attention, else the window its layers use
        self.windowed = any(windows)
        self.block_size = block_size
        self.prefix = pools[0].prefix  # the engine gives one only to a lone full-attention pool
        self.rows = TableRows(len(pools))

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq`'s tokens start with; the last token is never covered, since the step that
        computes it is the one that samples."""
        if self.prefix is None:
            return []
        extend_keys(seq.block_keys, seq.token_ids, self.block_size, seq.cache_root)
        blocks = []
        for entry in seq.block_keys[:(seq.num_tokens - 1) // self.block_size]:
            block = self.prefix.lookup(entry)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reuse(self, seq: Sequence) -> tuple[int, int]:
        """Start `seq` (which holds no blocks) from its cached prefix; returns (tokens reused, of those tokens
        brought back from the host tier)."""
        blocks = self.cached_prefix(seq)
        from_host = sum(self.pools[0].share(block) for block in blocks)
        if blocks:
            self.rows.write(seq, 0, len(seq.block_tables[0]), blocks)
        seq.block_tables[0].extend(blocks)
        seq.num_indexed = len(blocks)
        seq.num_computed = len(blocks) * self.block_size
        return seq.num_computed, from_host * self.block_size

    def prefetch(self, seq: Sequence) -> None:
        """Copy back from the host tier the blocks continuing `seq`'s cached prefix, ahead of its prefill."""
        host = self.prefix.host if self.prefix is not None else None
        if host is None:
            return
        pool = self.pools[0]
        cached = self.cached_prefix(seq)
        for block in cached:
            self.prefix.touch(block)  # so that room for the rest is not made by evicting these
        for entry in seq.block_keys[len(cached):(seq.num_tokens - 1) // self.block_size]:
            if not host.contains(entry) or not pool.can_allocate(1):
                return
            block = pool.allocate()
            host.load(entry, block)
            self.prefix.insert(block, entry, prefetched=True)
            pool.release(block)

    def index(self, seq: Sequence) -> None:
        """Cache the full blocks of `seq` computed since the last call."""
        full = seq.num_computed // self.block_size
        if self.prefix is None or full <= seq.num_indexed:  # most steps: no block filled up
            return
        extend_keys(seq.block_keys, seq.token_ids, self.block_size, seq.cache_root)
        for i in range(seq.num_indexed, full):
            self.prefix.insert(seq.block_tables[0][i], seq.block_keys[i])
        seq.num_indexed = max(seq.num_indexed, full)

    def recycle(self, seq: Sequence) -> None:
        """Free the ring blocks no query from `seq.num_computed` on can see (only `windowed` pools have any)."""
        for p, (pool, window, table) in enumerate(zip(self.pools, self.windows, seq.block_tables, strict=True)):
            if window == 0:
                continue
            # the next query sits at num_computed and sees keys after num_computed - window (Qwen3 has no sinks)
            b = min(len(table), (seq.num_computed - window + 1) // self.block_size) - 1
            while b >= 0 and table[b] >= 0:
                pool.release(table[b])
                table[b] = -1
                self.rows.clear(seq, p, b)
                b -= 1

    def try_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the blocks its next `num_tokens` tokens need (after `recycle`); False, and nothing taken,
        when some pool cannot."""
        needed = -(-(seq.num_computed + num_tokens) // self.block_size)
        held = len(seq.block_tables[0])  # every table has the same length
        if held >= needed:  # most decode steps
            return True
        missing = needed - held
        if not all(pool.can_allocate(missing) for pool in self.pools):
            return False
        for p, (pool, table) in enumerate(zip(self.pools, seq.block_tables, strict=True)):
            blocks = [pool.allocate() for _ in range(missing)]
            self.rows.write(seq, p, held, blocks)
            table.extend(blocks)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those `seq`'s tokens need: what a row's rejected drafts took (their K/V
        slots are written again when their positions are computed once more)."""
        needed = -(-seq.num_tokens // self.block_size)
        held = len(seq.block_tables[0])
        if held <= needed:
            return
        for p, (pool, table) in enumerate(zip(self.pools, seq.block_tables, strict=True)):
            for i in range(needed, held):
                if table[i] >= 0:
                    pool.release(table[i])
                self.rows.clear(seq, p, i)
            del table[needed:]

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; its computed full blocks (prompt and output alike) stay cached."""
        self.index(seq)
        self.rows.release(seq, len(seq.block_tables[0]))
        for pool, table in zip(self.pools, seq.block_tables, strict=True):
            # tail first, so the LRU evicts a chain's tail before the head that others are likelier to share
            for block in reversed(table):
                if block >= 0:
                    pool.release(block)
            table.clear()
        seq.num_indexed = 0

