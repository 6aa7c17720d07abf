"""Dense K/V rows for the sequences decoding on CPU, so decode attention reads views instead of gathering.

Decode attention over a paged pool first gathers every block of every sequence at every layer; on CPU that
copies about as many bytes per step as the weights of Qwen3-0.6B hold. Here each decoding sequence also owns
a row of a dense `[rows, length, kv_heads, head_dim]` tensor per full-attention layer: its new K/V is written
into the row, and attention reads `[:batch, :longest]` as a strided view. A row is filled from the pool when
its sequence starts decoding (after a prefill, or again after a pre-emption) and the last row moves into the
hole when one stops. The pool stays the source of truth. The copy is bounded by `max_bytes`; a step that
would need more runs on the paged path.
"""

from __future__ import annotations

import math

import torch

from engine.core.block_manager import table_tensor
from engine.core.kv_cache import GROWTH, KVCache
from engine.core.sequence import Sequence, Status
from kernels.torch_ops import decode_attention, gather_blocks

LENGTH_ALIGN = 64


class DenseDecodeKV:
    def __init__(self, cache: KVCache, pool: int, max_bytes: int, max_length: int, max_rows: int) -> None:
        self.cache = cache
        self.pool = pool  # the index of `cache` among the engine's pools
        self.max_bytes = max_bytes
        self.max_length = max_length  # no sequence gets longer than this
        self.max_rows = max_rows  # no step decodes more sequences than this
        num_layers, _, heads, dim = cache.shape
        self.bytes_per_token = 2 * num_layers * heads * dim * cache.dtype.itemsize
        self.data = torch.zeros(2, num_layers, 0, 0, heads, dim, dtype=cache.dtype, device=cache.device)
        self.order: list[Sequence] = []  # order[i] owns row i
        self.filled: dict[Sequence, int] = {}  # tokens of K/V each row holds
        self.rows = torch.arange(0)
        self.positions = torch.arange(0)
        self.mask = torch.ones(0, 1, 1, 0, dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def sync(self, seqs: list[Sequence], step_size: int) -> list[Sequence] | None:
        """Rows for this step's decoding `seqs` (of the step's `step_size` sequences, the rest prefilling, to
        decode soon); returns them in row order (the order the step must use), or None when they do not fit
        in `max_bytes` (the copy is then dropped and the step runs paged).

        A sequence still decoding but left out of this step (the scheduler keeps a step short) keeps its row
        for the steps it rejoins; this step's rows are moved to the front, a swap of two rows each, so that
        attention reads them as one view."""
        live = set(seqs)
        for seq in [s for s in self.order if s.status is not Status.RUNNING or self.filled[s] != s.num_computed]:
            self._drop(seq)
        longest = max(seq.num_computed + 1 for seq in seqs)
        final = max(seq.max_tokens for seq in seqs)
        new = [seq for seq in seqs if seq not in self.filled]
        if not self._fit(len(self.order) + len(new), longest, step_size, final):
            self.order, self.filled = [], {}
            return None
        self._fill(new)
        self._to_front(live)
        ordered = self.order[:len(seqs)]
        lens = torch.tensor([seq.num_computed + 1 for seq in ordered])
        self.rows = torch.arange(len(ordered))
        self.positions = lens - 1
        self.mask = (torch.arange(longest) < lens[:, None])[:, None, None, :]
        for seq in ordered:
            self.filled[seq] = seq.num_computed + 1  # what the row holds once this step has run
        return list(ordered)

    def _to_front(self, live: set[Sequence]) -> None:
        """Swap rows so that the first `len(live)` rows are those of `live`."""
        front = len(live)
        holes = [i for i in range(front) if self.order[i] not in live]
        strays = [i for i in range(front, len(self.order)) if self.order[i] in live]
        for a, b in zip(holes, strays, strict=True):
            length = max(self.filled[self.order[a]], self.filled[self.order[b]])
            kept = self.data[:, :, a, :length].clone()
            self.data[:, :, a, :length] = self.data[:, :, b, :length]
            self.data[:, :, b, :length] = kept
            self.order[a], self.order[b] = self.order[b], self.order[a]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention for pool layer `layer`: `q`, `k`, `v` are the new tokens, one per row."""
        keys, values = self.data[0, layer], self.data[1, layer]
        keys.index_put_((self.rows, self.positions), k)
        values.index_put_((self.rows, self.positions), v)
        longest = self.mask.shape[-1]
        batch = q.shape[0]
        return decode_attention(q, keys[:batch, :longest].transpose(1, 2), values[:batch, :longest].transpose(1, 2),
                                self.mask, scale)

    def _drop(self, seq: Sequence) -> None:
        row = self.order.index(seq)
        last = self.order.pop()
        del self.filled[seq]
        if last is not seq:
            self.data[:, :, row, : self.filled[last]] = self.data[:, :, len(self.order), : self.filled[last]]
            self.order[row] = last

    def _fit(self, rows: int, length: int, final_rows: int, final_length: int) -> bool:
        """Room for `rows` rows of `length` tokens. What grows, grows at least 1.5x (every growth copies
        everything and touches fresh memory): rows to at least `final_rows` (the sequences that will decode
        soon), the length to `final_length` (the longest these sequences can get) but never past
        `max_length`; when that is too big, as far towards it as `max_bytes` allows, at least to what this
        step needs."""
        old_rows, old_length = self.data.shape[2], self.data.shape[3]
        if rows <= old_rows and length <= old_length:
            return True
        grown_rows = old_rows
        if rows > old_rows:
            grown_rows = max(rows, min(max(final_rows, math.ceil(old_rows * GROWTH)), self.max_rows))
        grown_length = old_length
        if length > old_length:
            grown_length = min(max(length, final_length, math.ceil(old_length * GROWTH)), self.max_length)
        for want_length in (grown_length, max(length, old_length)):
            target = max(length, min(LENGTH_ALIGN * math.ceil(want_length / LENGTH_ALIGN), self.max_length))
            want_rows = min(grown_rows, self.max_bytes // (target * self.bytes_per_token))
            if want_rows >= max(rows, old_rows):
                grown = torch.zeros(*self.data.shape[:2], want_rows, target, *self.data.shape[4:],
                                    dtype=self.data.dtype, device=self.data.device)
                grown[:, :, :old_rows, :old_length] = self.data
                self.data = grown
                return True
        return False

    def _fill(self, seqs: list[Sequence]) -> None:
        """Copy the cached K/V of sequences that start decoding into new rows."""
        if not seqs:
            return
        rows = torch.arange(len(self.order), len(self.order) + len(seqs))
        self.order.extend(seqs)
        self.filled.update((seq, seq.num_computed) for seq in seqs)
        longest = max(seq.num_computed for seq in seqs)
        if longest == 0:
            return
        width = math.ceil(longest / self.cache.shape[1])
        tables = table_tensor([seq.block_tables[self.pool][:width] for seq in seqs])
        for kv in range(2):
            for layer in range(self.data.shape[1]):
                self.data[kv, layer, rows, :longest] = gather_blocks(self.cache.layer(layer)[kv], tables, longest)
