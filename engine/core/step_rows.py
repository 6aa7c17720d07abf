"""The scheduler's choice for a step (sequence -> new tokens) as a `StepPlan`, the plain rows the model reads.

Per-row numbers go through `np.fromiter` (`np.array` of a list is slower, `torch.tensor` several times so),
and the block tables are gathered from the block manager's `TableRows` instead of rebuilt from lists.

A row given more tokens than its sequence has uncomputed carries drafts (`Sequence.drafts`, engine.core.drafts):
its new tokens are its last token and the drafts, and each of its positions samples, as if every draft before
it had been accepted: its own draw counter, and for a penalty the history with those drafts in it.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from engine.core.block_manager import TableRows
from engine.core.sequence import Sequence
from engine.step import SamplingInputs, StepPlan


def step_plan(scheduled: dict[Sequence, int], tables: TableRows, block_size: int, released: list[str],
              drafted: int = 0) -> StepPlan:
    """`scheduled` as rows: single-token rows first in the order they were scheduled, then prefill chunks (and
    rows with drafts) by length; `released` is handed on as it is; `drafted`: the drafts the rows carry."""
    decodes = [seq for seq, n in scheduled.items() if n == 1]
    d = len(decodes)
    if d == len(scheduled):  # decodes only: one token per row, the one at `num_computed`
        seqs = decodes
        counts = np.ones(d, np.int64)
        input_ids = np.fromiter((seq.token_ids[seq.num_computed] for seq in seqs), np.int64, d)
    else:
        prefills = sorted(((seq, n) for seq, n in scheduled.items() if n > 1), key=itemgetter(1))
        seqs = decodes + [seq for seq, _ in prefills]
        counts = np.array([1] * d + [n for _, n in prefills], np.int64)
        chunks = [t for seq, n in prefills for t in new_tokens(seq, n)]
        input_ids = np.array([seq.token_ids[seq.num_computed] for seq in decodes] + chunks, np.int64)
    rows = len(seqs)
    starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, rows)
    ends = starts + counts
    width = max(1, -(-int(ends.max()) // block_size))  # the blocks the longest row needs
    block_tables = tables.gather(np.fromiter((seq.table_row for seq in seqs), np.intp, rows), width)
    request_ids = [seq.request_id for seq in seqs]
    lengths = np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, rows)
    drafts = np.maximum(ends - lengths, 0) if drafted else None
    sample_rows = np.flatnonzero(ends == lengths if drafts is None else ends - drafts == lengths)
    if len(sample_rows) == rows:
        sampled, sample_ids = seqs, request_ids
    else:
        sampled = [seqs[i] for i in sample_rows]
        sample_ids = [request_ids[i] for i in sample_rows]
    if drafts is None:
        prompt_lens = np.fromiter((seq.num_prompt_tokens for seq in sampled), np.int64, len(sampled))
        sampling = SamplingInputs([seq.params for seq in sampled], lengths[sample_rows] - prompt_lens, prompt_lens,
                                  [seq.token_ids if seq.penalized else None for seq in sampled])
    else:
        sampling, sample_ids = verify_positions(sampled, sample_ids, drafts[sample_rows])
    token_limits = np.fromiter((seq.token_limit for seq in seqs), np.int64, rows)
    return StepPlan(request_ids, d, starts, counts, token_limits, input_ids, block_tables, sample_rows, sample_ids,
                    sampling, released, drafts)


def new_tokens(seq: Sequence, n: int) -> list[int]:
    """The `n` tokens a row of `seq` computes: the next of its own, then its drafts when it has fewer."""
    if n <= seq.num_uncomputed:
        return seq.token_ids[seq.num_computed:seq.num_computed + n]
    return seq.token_ids[seq.num_computed:] + seq.drafts


def verify_positions(sampled: list[Sequence], ids: list[str], drafts: np.ndarray) -> tuple[SamplingInputs, list[str]]:
    """The sampling inputs of every position of the sampling rows (1 + its drafts each, in order), and the
    request id of each."""
    repeats = drafts + 1
    firsts = np.cumsum(repeats) - repeats
    offsets = np.arange(int(repeats.sum())) - np.repeat(firsts, repeats)  # each position's draft index
    prompt_lens = np.fromiter((seq.num_prompt_tokens for seq in sampled), np.int64, len(sampled))
    drawn = np.fromiter((len(seq.token_ids) for seq in sampled), np.int64, len(sampled)) - prompt_lens
    params, histories, position_ids = [], [], []
    for seq, request_id, r in zip(sampled, ids, repeats.tolist(), strict=True):
        params += [seq.params] * r
        position_ids += [request_id] * r
        if not seq.penalized:
            histories += [None] * r
        else:
            histories += [seq.token_ids] + [seq.token_ids + seq.drafts[:j] for j in range(1, r)]
    return SamplingInputs(params, np.repeat(drawn, repeats) + offsets, np.repeat(prompt_lens, repeats),
                          histories), position_ids
