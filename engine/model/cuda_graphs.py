"""Steps replayed from CUDA graphs: on a GPU a step of a few hundred tokens is bound by kernel launches.

- `DecodeGraphs`: whole decode steps, attention included, each batch size captured on first use. Padded rows
  write nothing (slot -1) and attend to one key of block 0. A KV pool that grows moves its tensors, which
  makes these graphs stale.
- `PieceGraphs`: other steps up to 512 tokens. Each piece of the model between two attentions replays a graph
  captured per 16-token bucket; attention, whose work depends on the sequences, runs eagerly between them on
  the real tokens (padded rows never reach a real one, and write no K/V). They never touch the KV pools, and
  are all captured at start, before the pool is sized, so its share of free memory already leaves theirs.

Both share one memory pool: graphs replay one at a time and copy every output out of it.
"""

from __future__ import annotations

import torch

from engine.core.kv_cache import KVCache
from engine.model.attention_batch import AttentionBatch, BatchPart, LayerSlot
from engine.model.decoder import CausalLM
from engine.model.layers import Rope
from kernels.dispatch import Ops

# the largest step `PieceGraphs` takes: beyond it a step's arithmetic outweighs its launches
MAX_PIECE_TOKENS = 512


class DecodeGraphs:
    def __init__(self, model: CausalLM, ops: Ops, caches: list[KVCache], layer_slots: list[LayerSlot],
                 max_batch: int, table_widths: list[int], pieces: PieceGraphs | None) -> None:
        """`pieces`: the piece graphs, captured already, whose memory pool these share (None: a pool of their
        own)."""
        self.model, self.ops, self.caches, self.layer_slots = model, ops, caches, layer_slots
        self.sizes = sorted({*(s for s in (1, 2, 4, 8, *range(16, max_batch, 16)) if s < max_batch), max_batch})
        n, device = max_batch, next(model.parameters()).device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int64, device=device)
        self.slots = [torch.full((n,), -1, dtype=torch.int64, device=device) for _ in caches]
        self.tables = [torch.zeros(n, w, dtype=torch.int32, device=device) for w in table_widths]
        self.hidden = torch.zeros(n, model.shape.hidden_size, dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mempool = pieces.mempool if pieces is not None else None
        self.versions: list[int] = []
        self.steps = 0  # replayed

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[torch.Tensor],
            seq_lens: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
        versions = [c.version for c in self.caches]
        if versions != self.versions:
            self.graphs.clear()
            self.versions = versions
        b = len(input_ids)
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.seq_lens[:b].copy_(seq_lens)
        self.seq_lens[b:size] = 1
        for buf, s in zip(self.slots, slots, strict=True):
            buf[:b].copy_(s)
            buf[b:size] = -1
        for buf, t in zip(self.tables, tables, strict=True):
            buf[:size] = 0  # padded rows read block 0 (their one key), never a -1 entry
            buf[:b, : t.shape[1]].copy_(t)
        graph = self.graphs.get(size) or self._capture(size)
        graph.replay()
        self.steps += 1
        return self.hidden[:b]

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        batch = AttentionBatch(
            self.ops, self.caches, self.layer_slots, [s[:size] for s in self.slots],
            [BatchPart(0, size, self.cu_seqlens[: size + 1], self.seq_lens[:size], [t[:size] for t in self.tables])],
        )

        def forward() -> None:
            self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], batch)

        forward()  # compiles and autotunes the kernels outside the capture; rewrites the same K/V on replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            forward()
        self.mempool = graph.pool()
        self.graphs[size] = graph
        return graph


class PieceGraphs:
    def __init__(self, model: CausalLM, max_tokens: int) -> None:
        """Steps of up to `max_tokens` (at most `MAX_PIECE_TOKENS`). On a CPU the pieces run as plain calls
        instead of replays: the same buckets, buffers and padding, so tests check them without a GPU."""
        self.model = model
        top = min(max_tokens, MAX_PIECE_TOKENS)
        self.sizes = sorted({s for s in (8, *range(16, top + 1, 16)) if s <= top} | {top})
        shape, n = model.shape, self.sizes[-1]
        self.device, dtype = next(model.parameters()).device, model.lm_head.weight.dtype
        self.ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)

        def rows(*dims: int) -> torch.Tensor:
            return torch.zeros(n, *dims, dtype=dtype, device=self.device)

        self.q = rows(shape.num_heads, shape.head_dim)
        self.k, self.v = rows(shape.num_kv_heads, shape.head_dim), rows(shape.num_kv_heads, shape.head_dim)
        self.attention = rows(shape.num_heads, shape.head_dim)  # the output of the attention between pieces
        self.residual, self.hidden = rows(shape.hidden_size), rows(shape.hidden_size)
        self.graphs: dict[int, list] = {}  # size -> per piece, its replay (a plain call on a CPU)
        self.mempool = None
        self.steps = 0  # run in pieces
        self.nbytes = 0  # the graphs and these buffers, once `capture` measured them (CUDA)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Final hidden states of the step's `len(input_ids)` tokens, as `DecoderModel.forward` computes them."""
        t = len(input_ids)
        size = next(s for s in self.sizes if s >= t)
        pieces = self.graphs.get(size) or self._capture(size)
        # padded rows keep earlier steps' ids and positions: valid indexes, and no real row reads them
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        layers = self.model.model.layers
        for i, piece in enumerate(pieces):
            piece()
            if i < len(layers):
                out = batch.attend(i, self.q[:t], self.k[:t], self.v[:t], layers[i].self_attn.scale)
                self.attention[:t].copy_(out)
        self.steps += 1
        return self.hidden[:t]

    def capture(self) -> None:
        """Captures every size, the largest first (the others reuse its memory), and measures what the graphs
        and buffers take."""
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        for size in reversed(self.sizes):
            self._capture(size)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # what the warm-up calls cached outside the graphs' pool is free memory
            buffers = [self.ids, self.positions, self.q, self.k, self.v, self.attention, self.residual, self.hidden]
            self.nbytes = torch.cuda.memory_reserved(self.device) - before + sum(b.nbytes for b in buffers)

    def _capture(self, size: int) -> list:
        model = self.model.model
        last = len(model.layers)
        rope = Rope(self.model.rope_cos, self.model.rope_sin, self.positions[:size])

        def piece(i: int):
            def body() -> None:
                x = self.ids[:size] if i == 0 else self.attention[:size]
                out = model.piece(i, x, self.residual[:size] if i else None, rope)
                if i == last:
                    self.hidden[:size].copy_(out)
                    return
                for buf, t in zip((self.q, self.k, self.v, self.residual), out, strict=True):
                    buf[:size].copy_(t)
            return body

        with torch.inference_mode():
            self.graphs[size] = [self._record(piece(i)) for i in range(last + 1)]
        return self.graphs[size]

    def _record(self, body):
        if self.device.type != "cuda":
            return body
        body()  # compiles and autotunes the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            body()
        self.mempool = graph.pool()
        return graph.replay
