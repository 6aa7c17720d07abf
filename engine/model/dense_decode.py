"""Dense K/V rows for the sequences decoding on CPU, so decode attention reads views instead of gathering.

Decode attention over a paged pool first gathers every block of every sequence at every layer; on CPU that
copies about as many bytes per step as the weights of Qwen3-0.6B hold. Here each decoding sequence also owns
a row of a dense `[rows, length, kv_heads, head_dim]` tensor per full-attention layer: its new K/V is written
into the row, and attention reads `[:batch, :longest]` as a strided view. A row is filled from the pool when
its sequence starts decoding (after a prefill, or again after a pre-emption) and the last row moves into the
hole when one stops. A row verifying drafts writes its token and its drafts into its row and attends like a
decode with a query each (what was rejected is written over next step): as an extend it would gather its
whole context from the pool and cost what several decode rows do. Rows are keyed by request id, and a plan's
`released` requests lose theirs. The pool stays the source of truth. The copy is bounded by `max_bytes`; a
step that would need more runs paged.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.core.kv_cache import GROWTH, KVCache
from engine.step import StepPlan
from kernels.attention_ref import visible
from kernels.torch_ops import additive, decode_attention, gather_blocks, queries_attention

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
        self.order: list[str] = []  # order[i]: the request that owns row i
        self.filled: dict[str, int] = {}  # request -> tokens of K/V its row holds
        # this step's: per new token, its row and position; per row, the keys its first token sees; per row
        # verifying drafts, its row, its tokens, its length and what each of its tokens sees; and where some
        # rows verify drafts and others not, each row's first token
        self.rows = torch.arange(0)
        self.positions = torch.arange(0)
        self.mask = torch.zeros(0, 1, 1, 0)
        self.firsts: torch.Tensor | None = None
        self.drafts: list[tuple[int, int, int, int, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def release(self, request_ids: list[str]) -> None:
        """Drop the rows of requests that finished or were pre-empted."""
        for request_id in request_ids:
            if request_id in self.filled:
                self._drop(request_id)

    def sync(self, plan: StepPlan, rows: np.ndarray) -> np.ndarray | None:
        """Rows for the plan's `rows`: its decodes, and its rows verifying drafts (a decode's token and its
        drafts, `1 + k` queries). Returns those plan rows in row order (the order the step must use), or None
        when they do not fit in `max_bytes` (the copy is then dropped and the step runs paged).

        A request still decoding but left out of this step (the scheduler keeps a step short) keeps its row
        for the steps it rejoins; this step's rows are moved to the front, a swap of two rows each, so that
        attention reads them as one view."""
        starts = plan.starts[rows]
        live = {plan.request_ids[i]: i for i in rows.tolist()}  # request -> its plan row
        for request_id in self.order:
            if request_id in live and self.filled[request_id] > plan.starts[live[request_id]]:
                # the drafts its last step verified were rejected: the tokens before its start stand, and
                # those after it will be written again
                self.filled[request_id] = int(plan.starts[live[request_id]])
        longest = int((starts + plan.counts[rows]).max())
        final = int(plan.token_limits[rows].max())
        new = [i for i in rows.tolist() if plan.request_ids[i] not in self.filled]
        if not self._fit(len(self.order) + len(new), longest, len(plan.request_ids), final):
            self.order, self.filled = [], {}
            return None
        # K/V that moved on without its row (a step that ran paged, a single-token prefill chunk): copy only
        # the tokens it missed, not the whole context again
        self._catch_up(plan, [(r, live[r]) for r in self.order if r in live and self.filled[r] < plan.starts[live[r]]])
        self._fill(plan, new)
        self._to_front(live)
        ordered = np.array([live[request_id] for request_id in self.order[:len(rows)]], np.intp)
        starts, counts = plan.starts[ordered], plan.counts[ordered]
        ends = starts + counts
        firsts = np.cumsum(counts) - counts  # each row's first new token
        self.rows = torch.from_numpy(np.repeat(np.arange(len(ordered)), counts))
        self.positions = torch.from_numpy(np.repeat(starts - firsts, counts) + np.arange(int(counts.sum())))
        seen = visible(torch.from_numpy(starts), torch.arange(int(starts.max()) + 1), window=0, sinks=0)
        self.mask = additive(seen[:, None, None], self.data.dtype)
        # a row verifying drafts attends on its own, to its row's view, each query up to its own position:
        # padding every row to the most queries any has would compute several times the attention the step needs
        self.drafts = []
        for row in np.flatnonzero(counts > 1).tolist():
            start, end = int(starts[row]), int(ends[row])
            seen = visible(torch.arange(start, end), torch.arange(end), window=0, sinks=0)
            self.drafts.append((row, int(firsts[row]), int(firsts[row] + counts[row]), end,
                                additive(seen[None, None], self.data.dtype)))
        # the batched call serves the single-token rows (and, overwritten after, the others' first tokens)
        self.firsts = torch.from_numpy(firsts) if self.drafts and len(self.drafts) < len(counts) else None
        for request_id, end in zip(self.order[:len(rows)], ends.tolist(), strict=True):
            self.filled[request_id] = end  # what the row holds once this step has run
        return ordered

    def _to_front(self, live: dict[str, int]) -> None:
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
        """Attention for pool layer `layer`: `q`, `k`, `v` are the new tokens of the rows `sync` ordered."""
        keys, values = self.data[0, layer], self.data[1, layer]
        keys.index_put_((self.rows, self.positions), k)
        values.index_put_((self.rows, self.positions), v)
        batch, longest = self.mask.shape[0], self.mask.shape[3]
        view = keys[:batch, :longest].transpose(1, 2), values[:batch, :longest].transpose(1, 2)
        if not self.drafts:  # one token a row
            return decode_attention(q, *view, self.mask, scale)
        out = torch.empty_like(q)
        if self.firsts is not None:
            out[self.firsts] = decode_attention(q[self.firsts], *view, self.mask, scale)
        for row, first, end, length, mask in self.drafts:
            view = keys[row:row + 1, :length].transpose(1, 2), values[row:row + 1, :length].transpose(1, 2)
            out[first:end] = queries_attention(q[None, first:end], *view, mask, scale)[0]
        return out

    def _drop(self, request_id: str) -> None:
        row = self.order.index(request_id)
        last = self.order.pop()
        del self.filled[request_id]
        if last != request_id:
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

    def _catch_up(self, plan: StepPlan, behind: list[tuple[str, int]]) -> None:
        """Copy into the rows of `behind` (request, its plan row) the cached K/V of the tokens from what each row
        holds up to its plan row's start."""
        block_size = self.cache.shape[1]
        for request_id, i in behind:
            row, have, start = self.order.index(request_id), self.filled[request_id], int(plan.starts[i])
            first = have // block_size
            table = torch.from_numpy(plan.block_tables[self.pool][i, first:-(-start // block_size)])
            span = slice(have - first * block_size, start - first * block_size)
            for kv in range(2):
                for layer in range(self.data.shape[1]):
                    tokens = gather_blocks(self.cache.layer(layer)[kv], table, len(table) * block_size)
                    self.data[kv, layer, row, have:start] = tokens[span]
            self.filled[request_id] = start

    def _fill(self, plan: StepPlan, new: list[int]) -> None:
        """Copy the cached K/V of the requests of plan rows `new`, which start decoding, into new rows."""
        if not new:
            return
        rows = torch.arange(len(self.order), len(self.order) + len(new))
        self.order.extend(plan.request_ids[i] for i in new)
        self.filled.update((plan.request_ids[i], int(plan.starts[i])) for i in new)
        longest = int(plan.starts[new].max())
        if longest == 0:
            return
        width = math.ceil(longest / self.cache.shape[1])
        tables = torch.from_numpy(plan.block_tables[self.pool][new, :width])
        for kv in range(2):
            for layer in range(self.data.shape[1]):
                self.data[kv, layer, rows, :longest] = gather_blocks(self.cache.layer(layer)[kv], tables, longest)
