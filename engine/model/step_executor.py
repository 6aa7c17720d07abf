"""One planned step through the model: packs the plan's rows, runs the forward, samples the next tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.kv_cache import KVCache
from engine.model.acceptance import accept, sample_positions
from engine.model.attention_batch import AttentionBatch, BatchPart, LayerSlot
from engine.model.cuda_graphs import DecodeGraphs, PieceGraphs
from engine.model.decoder import CausalLM
from engine.model.dense_decode import DenseDecodeKV
from engine.model.sampler import sample
from engine.step import StepPlan, StepResult, TokenMasks
from kernels.dispatch import Ops


@dataclass
class PackedStep:
    """A plan's rows as tensors on the host, in the order the kernels take them: single-token rows first (in
    the dense rows' order, with the rows verifying drafts, when those serve them), then prefill chunks."""

    request_ids: list[str]
    packed_at: np.ndarray | None  # per plan row, its row here; None: the plan's own order
    num_decodes: int  # the leading rows attended as decodes: one token each, or through dense rows also the
    # rows verifying drafts
    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    tables: list[torch.Tensor]  # per KV pool, -1 padded
    slots: list[torch.Tensor]  # per KV pool
    dense: bool  # the decodes attend through `DenseDecodeKV` rows

    def last_tokens(self, plan_rows: np.ndarray) -> np.ndarray:
        """Where in the packed tokens each of `plan_rows` ends."""
        rows = plan_rows if self.packed_at is None else self.packed_at[plan_rows]
        return self.cu_seqlens.numpy()[1:][rows] - 1


class StepExecutor:
    """Runs each `StepPlan` on the model and its KV caches (`engine.builder` makes one per engine)."""

    def __init__(self, model: CausalLM, caches: list[KVCache], layer_slots: list[LayerSlot],
                 ops: Ops, block_size: int, graphs: DecodeGraphs | None, pieces: PieceGraphs | None,
                 dense: DenseDecodeKV | None) -> None:
        self.model = model
        self.caches = caches
        self.layer_slots = layer_slots
        self.ops = ops
        self.block_size = block_size
        self.graphs = graphs
        self.pieces = pieces
        self.dense = dense
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, plan: StepPlan, masks: Callable[[], TokenMasks | None] | None = None) -> StepResult:
        """Computes the plan's new tokens; returns the next token of each row that reached its request's end
        (a row with drafts: the tokens it keeps, engine.model.acceptance). `masks` gives the constrained sample
        positions' grammar masks: called once the forward is queued on the device, so that on a GPU they are
        filled while it runs."""
        logits = self.logits(plan)
        if logits is None:
            return StepResult([], [])
        tokens, logprobs = sample(logits, plan.sampling, masks() if masks is not None else None)
        return accept(plan, tokens, logprobs)

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor | None:
        """The forward of the plan's new tokens, and the logits of its sample positions (None: no row samples).
        What a tensor-parallel rank other than the first runs of each step: the same collectives, no sampling."""
        step = self.pack(plan)
        hidden = self.forward(step)
        if not len(plan.sample_rows):
            return None
        last = step.last_tokens(plan.sample_rows)
        if plan.drafts is not None:
            last = sample_positions(last, plan.drafts[plan.sample_rows])
        return self.model.compute_logits(hidden[torch.from_numpy(last).to(self.device)])

    def pack(self, plan: StepPlan) -> PackedStep:
        """The step's inputs on the host. Where dense rows serve the decodes (and the rows verifying drafts),
        those come first, in the rows' order."""
        d, rows = plan.num_decodes, len(plan.request_ids)
        if self.dense is not None:
            self.dense.release(plan.released)
        leading = np.arange(d)
        if self.dense is not None and plan.drafts is not None:
            leading = np.concatenate([leading, d + np.flatnonzero(plan.drafts[d:])])
        dense_order = self.dense.sync(plan, leading) if self.dense is not None and len(leading) else None
        request_ids, starts, counts, input_ids, tables, packed_at = (plan.request_ids, plan.starts, plan.counts,
                                                                     plan.input_ids, plan.block_tables, None)
        if dense_order is not None and (dense_order != np.arange(len(dense_order))).any():
            order = np.concatenate([dense_order, np.setdiff1d(np.arange(rows), dense_order, assume_unique=True)])
            request_ids = [request_ids[i] for i in order]
            starts, counts, tables = starts[order], counts[order], [t[order] for t in tables]
            # each packed token's place in the plan's `input_ids`: its row's first there plus its offset
            firsts = np.cumsum(plan.counts) - plan.counts
            offsets = np.arange(len(input_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
            input_ids = input_ids[np.repeat(firsts[order], counts) + offsets]
            packed_at = np.empty(rows, np.intp)
            packed_at[order] = np.arange(rows)
        if len(input_ids) == rows:  # one token per row, at the row's context length
            row, positions = np.arange(rows), starts
        else:
            row = np.repeat(np.arange(rows), counts)
            # each token's position: its row's first new position plus its offset into the row's chunk
            offsets = np.cumsum(counts) - counts
            positions = starts[row] + np.arange(len(input_ids)) - offsets[row]
        seq_lens = starts + counts
        cu_seqlens = np.zeros(rows + 1, np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        block, offset = positions // self.block_size, positions % self.block_size
        slots = [torch.from_numpy(t[row, block].astype(np.int64) * self.block_size + offset) for t in tables]
        leading_rows = d if dense_order is None else len(dense_order)
        return PackedStep(request_ids, packed_at, leading_rows, torch.from_numpy(input_ids),
                          torch.from_numpy(positions), torch.from_numpy(cu_seqlens), torch.from_numpy(seq_lens),
                          [torch.from_numpy(t) for t in tables], slots, dense=dense_order is not None)

    @torch.inference_mode()
    def forward(self, step: PackedStep) -> torch.Tensor:
        """Final hidden states of every packed token."""
        rows, tokens = len(step.request_ids), len(step.input_ids)
        if self.graphs is not None and tokens == rows and self.graphs.fits(rows):
            return self.graphs.run(step.input_ids, step.positions, step.slots, step.seq_lens, step.tables)
        d, pools = step.num_decodes, len(step.tables)
        split = int(step.cu_seqlens[d])  # the leading rows' tokens
        input_ids, positions, cu_seqlens, seq_lens, *rest = upload(
            [step.input_ids, step.positions, step.cu_seqlens, step.seq_lens, *step.tables, *step.slots], self.device)
        tables, slots = rest[:pools], rest[pools:]
        parts = []
        if d:
            parts.append(BatchPart(0, split, cu_seqlens[:d + 1], seq_lens[:d], [t[:d] for t in tables],
                                   self.dense if step.dense else None))
        if d < rows:
            parts.append(BatchPart(split, tokens, cu_seqlens[d:] - split, seq_lens[d:], [t[d:] for t in tables]))
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

