"""The scheduler's choice for a step (sequence -> new tokens) as a `StepPlan`, the plain rows the model reads.

Per-row numbers go through `np.fromiter` (`np.array` of a list is slower, `torch.tensor` several times so),
and the block tables are gathered from the block manager's `TableRows` instead of rebuilt from lists.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from engine.core.block_manager import TableRows
from engine.core.sequence import Sequence
from engine.step import SamplingInputs, StepPlan


def step_plan(scheduled: dict[Sequence, int], tables: TableRows, block_size: int, released: list[str]) -> StepPlan:
    """`scheduled` as rows: single-token rows first in the order they were scheduled, then prefill chunks by
    length; `released` is handed on as it is."""
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
        chunks = [t for seq, n in prefills for t in seq.token_ids[seq.num_computed:seq.num_computed + n]]
        input_ids = np.array([seq.token_ids[seq.num_computed] for seq in decodes] + chunks, np.int64)
    rows = len(seqs)
    starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, rows)
    ends = starts + counts
    width = max(1, -(-int(ends.max()) // block_size))  # the blocks the longest row needs
    block_tables = tables.gather(np.fromiter((seq.table_row for seq in seqs), np.intp, rows), width)
    request_ids = [seq.request_id for seq in seqs]
    sample_rows = np.flatnonzero(ends == np.fromiter((len(seq.token_ids) for seq in seqs), np.int64, rows))
    if len(sample_rows) == rows:
        sampled, sample_ids = seqs, request_ids
    else:
        sampled = [seqs[i] for i in sample_rows]
        sample_ids = [request_ids[i] for i in sample_rows]
    prompt_lens = np.fromiter((seq.num_prompt_tokens for seq in sampled), np.int64, len(sampled))
    sampling = SamplingInputs([seq.params for seq in sampled], ends[sample_rows] - prompt_lens, prompt_lens,
                              [seq.token_ids if seq.penalized else None for seq in sampled])
    token_limits = np.fromiter((seq.token_limit for seq in seqs), np.int64, rows)
    return StepPlan(request_ids, d, starts, counts, token_limits, input_ids, block_tables, sample_rows, sample_ids,
                    sampling, released)
