"""One scheduled step through the model: packs the inputs, runs the forward, samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.block_manager import TableRows
from engine.core.kv_cache import KVCache
from engine.core.sequence import Sequence
from engine.model.attention import AttentionBatch, BatchPart, LayerSlot
from engine.model.cuda_graphs import DecodeGraphs, PieceGraphs
from engine.model.dense_decode import DenseDecodeKV
from engine.model.qwen3 import Qwen3ForCausalLM
from engine.model.sampler import sample
from kernels.dispatch import Ops


@dataclass
class Step:
    """One step's batch packed on the host: `seqs[i]` brings `counts[i]` new tokens; decodes come first."""

    seqs: list[Sequence]
    counts: list[int]
    num_decodes: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    tables: list[torch.Tensor]  # per KV pool, -1 padded
    slots: list[torch.Tensor]  # per KV pool
    dense: bool  # the decodes attend through `DenseDecodeKV` rows


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, caches: list[KVCache], layer_slots: list[LayerSlot],
                 ops: Ops, block_size: int, graphs: DecodeGraphs | None, pieces: PieceGraphs | None,
                 dense: DenseDecodeKV | None, tables: TableRows) -> None:
        self.model = model
        self.tables = tables  # the block manager's: every sequence's block tables, one row each
        self.caches = caches
        self.layer_slots = layer_slots
        self.ops = ops
        self.block_size = block_size
        self.graphs = graphs
        self.pieces = pieces
        self.dense = dense
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """Computes `n` new tokens of each (sequence, n); returns the next token of each that reached its end."""
        step = self.pack(batch)
        hidden = self.forward(step)
        ends = [i for i, (seq, n) in enumerate(zip(step.seqs, step.counts, strict=True))
                if seq.num_computed + n == seq.num_tokens]
        if not ends:
            return {}
        last = torch.from_numpy(step.cu_seqlens.numpy()[1:][ends] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])
        seqs = [step.seqs[i] for i in ends]
        tokens = sample(logits, seqs)
        return dict(zip(seqs, tokens, strict=True))

    def pack(self, batch: list[tuple[Sequence, int]]) -> Step:
        """The step's inputs on the host: single-query sequences first (the backend takes them in one call, in
        the dense rows' order when those serve them), then prefill chunks by length. Lists of per-row numbers
        become tensors through numpy (`torch.tensor` of a list is several times slower), and the block tables
        are gathered from the block manager's `TableRows`."""
        decodes = [seq for seq, n in batch if n == 1]
        ordered = self.dense.sync(decodes, len(batch)) if self.dense is not None and decodes else None
        prefills = sorted(((s, n) for s, n in batch if n > 1), key=lambda item: item[1])
        seqs = (ordered or decodes) + [seq for seq, _ in prefills]
        d, rows = len(decodes), len(seqs)
        computed = np.fromiter((seq.num_computed for seq in seqs), np.int64, rows)
        # a decode's one new token is the one at `num_computed`: no slice per row
        input_ids = [seq.token_ids[seq.num_computed] for seq in seqs[:d]]
        if d == rows:  # decodes only: one token per row, at the row's context length
            counts = np.ones(rows, np.int64)
            row, positions = np.arange(rows), computed
        else:
            input_ids += [t for seq, n in prefills for t in seq.token_ids[seq.num_computed:seq.num_computed + n]]
            counts = np.array([1] * d + [n for _, n in prefills], np.int64)
            row = np.repeat(np.arange(rows), counts)
            # each token's position: its row's first new position plus its offset into the row's chunk
            starts = np.cumsum(counts) - counts
            positions = computed[row] + np.arange(len(input_ids)) - starts[row]
        seq_lens = computed + counts
        cu_seqlens = np.zeros(rows + 1, np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        table_rows = np.fromiter((seq.table_row for seq in seqs), np.intp, rows)
        width = max(1, -(-int(seq_lens.max()) // self.block_size))  # the blocks the longest row needs
        tables = self.tables.gather(table_rows, width)
        slot_of = (positions // self.block_size, positions % self.block_size)
        slots = [torch.from_numpy(t.numpy()[row, slot_of[0]].astype(np.int64) * self.block_size + slot_of[1])
                 for t in tables]
        return Step(seqs, counts.tolist(), d, torch.from_numpy(np.array(input_ids, np.int64)),
                    torch.from_numpy(positions), torch.from_numpy(cu_seqlens), torch.from_numpy(seq_lens), tables,
                    slots, dense=ordered is not None)

    @torch.inference_mode()
    def forward(self, step: Step) -> torch.Tensor:
        """Final hidden states of every packed token."""
        if self.graphs is not None and step.num_decodes == len(step.seqs) and self.graphs.fits(len(step.seqs)):
            return self.graphs.run(step.input_ids, step.positions, step.slots, step.seq_lens, step.tables)
        d, pools = step.num_decodes, len(step.tables)
        input_ids, positions, cu_seqlens, seq_lens, *rest = upload(
            [step.input_ids, step.positions, step.cu_seqlens, step.seq_lens, *step.tables, *step.slots], self.device)
        tables, slots = rest[:pools], rest[pools:]
        parts = []
        if d:
            parts.append(BatchPart(0, d, cu_seqlens[:d + 1], seq_lens[:d], [t[:d] for t in tables],
                                   self.dense if step.dense else None))
        if d < len(step.seqs):
            parts.append(BatchPart(d, len(step.input_ids), cu_seqlens[d:] - d, seq_lens[d:], [t[d:] for t in tables]))
        attn = AttentionBatch(self.ops, self.caches, self.layer_slots, slots, parts)
        if self.pieces is not None and self.pieces.fits(len(input_ids)):
            return self.pieces.run(input_ids, positions, attn)
        return self.model(input_ids, positions, attn)


def upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A step's small integer inputs on `device`: on CUDA one pinned host buffer and one non-blocking copy
    for all of them instead of a synchronous pageable copy each; elsewhere they stay where they are."""
    if device.type != "cuda":
        return tensors
    return split_copy(tensors, device, pin=True)


def split_copy(tensors: list[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """`tensors` (integer, on the host) copied to `device` through one flat int64 buffer, each back in its
    shape and dtype."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    if pin:
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=pin)
    out, start = [], 0
    for t in tensors:
        out.append(moved[start:start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out

