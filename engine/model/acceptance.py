"""Which sampled tokens of a step stand, when rows carry drafts: the speculative-sampling rule for a draft that
is a single token, not a distribution.

Each position of a row with drafts is sampled from the target's final distribution p there (penalties,
temperature, top-k/top-p/min-p and the grammar's mask applied, as if the drafts before it were accepted), by the
sampler's one inverse-CDF draw. Draft d is accepted when that draw is d: with probability p(d), the mass of d's
interval. Otherwise the draw fell outside that interval, uniformly over the rest of the mass, so the token it
names is a draw from p with d removed and renormalized: the rule's rejection sample, from the same number. After
every draft of a row is accepted, its last position is the bonus token. Greedy rows take the argmax, so a draft
stands exactly while it is the argmax. A row keeps its tokens up to the first rejected draft's replacement.

Drawn this way, the token at each position is the token decoding one at a time would draw there: the same
distribution, and for a seeded request (whose number depends only on its seed and its count of drawn tokens)
the same token, whichever drafts the step carried.
"""

from __future__ import annotations

import numpy as np

from engine.interface import TokenLogprobs
from engine.step import StepPlan, StepResult


def sample_positions(last: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Where in the packed tokens each sample position lies: for each sample row, ending at `last` (its last
    token), its 1 + `drafts` final tokens in order."""
    repeats = drafts + 1
    firsts = np.cumsum(repeats) - repeats
    return np.repeat(last - drafts, repeats) + np.arange(int(repeats.sum())) - np.repeat(firsts, repeats)


def accept(plan: StepPlan, tokens: list[int], logprobs: list[TokenLogprobs | None] | None) -> StepResult:
    """The step's result from the tokens sampled at every sample position of `plan`: each row's tokens up to and
    including the first that differs from the draft after it."""
    if plan.drafts is None:
        return StepResult(plan.sample_ids, tokens, logprobs)
    drafts = plan.drafts[plan.sample_rows]
    ends = np.cumsum(plan.counts)[plan.sample_rows]  # in the plan's own order of `input_ids`
    firsts = np.cumsum(drafts + 1) - (drafts + 1)
    keep = np.ones(len(tokens), bool)
    for row in np.flatnonzero(drafts).tolist():
        k, first = int(drafts[row]), int(firsts[row])
        proposed = plan.input_ids[ends[row] - k:ends[row]].tolist()
        for j in range(k):
            if tokens[first + j] != proposed[j]:
                keep[first + j + 1:first + k + 1] = False
                break
    kept = np.flatnonzero(keep).tolist()
    return StepResult([plan.sample_ids[i] for i in kept], [tokens[i] for i in kept],
                      [logprobs[i] for i in kept] if logprobs is not None else None)
