"""One engine step as it travels: the contract between the scheduler (`engine.core`) and the model (`engine.model`).

The scheduler plans a step as a `StepPlan`; `StepExecutor.run(plan)` reads nothing else and returns a
`StepResult`, which `LLMEngine` applies to its sequences. A plan is plain data (lists, numpy arrays, frozen
sampling parameters), never a scheduler object, so that a step can be planned while the one before it runs
and tensor-parallel ranks can all be handed the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.interface import SamplingParams, TokenLogprobs


@dataclass
class SamplingInputs:
    """What the sampler needs of the rows that sample, in the order they sample (a row with drafts: each of its
    positions in turn, `StepPlan.drafts`)."""

    params: list[SamplingParams]
    drawn: np.ndarray  # output tokens each row's request has so far: a seeded row's draw counter
    prompt_lens: np.ndarray
    # per row with a repetition or presence penalty (None for the others), its request's prompt and output so
    # far: a read-only reference to the sequence's own list, not a copy, since copying histories every step
    # would cost more than sampling does; nothing appends to it before the step's tokens come back
    histories: list[list[int] | None]


@dataclass
class StepPlan:
    """A step's rows, each one request computing its next tokens: decodes (one new token each) first, then
    prefill chunks, shortest first. Per-row numbers are int64 arrays in row order."""

    request_ids: list[str]
    num_decodes: int  # the leading rows, one new token each
    starts: np.ndarray  # tokens of the row's request already in the KV cache: its first new token's position
    counts: np.ndarray  # new tokens of the row
    token_limits: np.ndarray  # the most tokens the row's request can ever hold (for state kept per request)
    input_ids: np.ndarray  # the rows' new tokens, back to back
    block_tables: list[np.ndarray]  # per KV pool, int32 [rows, blocks the longest row needs], -1 where none is
    sample_rows: np.ndarray  # the rows whose new tokens reach their request's last token: each samples one
    sample_ids: list[str]  # their request ids (a row with drafts: once per position)
    sampling: SamplingInputs | None  # for those rows, in that order (None: the plan a tensor-parallel rank other
    # than the first gets, which does not sample)
    released: list[str]  # requests finished or pre-empted since the last plan: state kept for them is stale
    # per row, how many of its last new tokens are drafts (engine.core.drafts): such a row samples at each of its
    # last 1 + drafts positions, and keeps the tokens up to the first that differs from the draft before it
    # (engine.model.acceptance); None: no row has any
    drafts: np.ndarray | None = None


@dataclass
class TokenMasks:
    """The grammar masks of a step's constrained sample rows: `bitmask[row]` (int32 words, a bit per token, set
    where the token is allowed) for each of `rows`; the other rows of `bitmask` are not read."""

    rows: list[int]
    bitmask: torch.Tensor


@dataclass
class StepResult:
    request_ids: list[str]  # the requests that sampled (a row with drafts: once per token it keeps, in order)
    token_ids: list[int]  # the token each sampled
    # per sampled request, its token's log-probabilities when it asked for them (None otherwise); None: no
    # request of the step asked
    logprobs: list[TokenLogprobs | None] | None = None
