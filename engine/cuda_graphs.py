"""Decode steps replayed from CUDA graphs.

On a GPU a decode step of a small batch is bound by kernel launches, so each batch-size bucket is captured
once (on first use) and replayed with its inputs copied into static buffers; padded rows write nothing
(slot -1) and attend to one key of block 0. Growing a KV pool moves its tensor, which makes every graph stale.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBatch, BatchPart, LayerSlot
from engine.kv_cache import KVCache
from engine.model import Qwen3ForCausalLM
from kernels.dispatch import Ops


class DecodeGraphs:
    def __init__(self, model: Qwen3ForCausalLM, ops: Ops, caches: list[KVCache],
                 layer_slots: list[LayerSlot], max_batch: int, table_widths: list[int]) -> None:
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
        self.mempool = None
        self.versions: list[int] = []

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
