"""What a step will cost, learned from the steps the engine ran.

A step's time is close to linear in a fixed part, prefill tokens, decode rows, the K/V those rows read
(rows times the longest context: batched decode attention pads to it) and the rows that verify drafts (each
attends on its own beside the batched decodes: on a CPU, where attention is most of a step, its drafts' own
attention call costs what a decode row or so does; on a GPU next to nothing). The coefficients differ by
orders of magnitude between machines and models, so none is configured: they are fitted online by least
squares over recent steps (older ones decay by `forgetting`, so the fit follows a machine whose speed
drifts), pulled weakly towards a prior until the steps have varied enough. The squares are of relative errors: the decisions
that matter are about small steps, which the many large bulk steps would otherwise outweigh.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from engine.step import StepPlan

# prefill tokens / 1e3, decode rows / 1e2, context tokens / 1e5, draft rows / 1e2: weights of similar size, a
# well-posed fit
SCALE = np.array([1.0, 1e-3, 1e-2, 1e-5, 1e-2])


class Work(NamedTuple):
    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_longest: int = 0  # the longest context among the decode rows
    draft_rows: int = 0  # of the decode rows, those that carry drafts

    def features(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_rows, self.decode_rows * self.decode_longest,
                         self.draft_rows]) * SCALE


def work_of(plan: StepPlan) -> Work:
    """The work of a planned step. A row with drafts is a decode row (it reads its context as one does), a draft
    row, and its drafts are tokens of compute beside it, as the scheduler planned them."""
    d = plan.num_decodes
    decoding = slice(0, d) if plan.drafts is None else (np.arange(len(plan.counts)) < d) | (plan.drafts > 0)
    rows = d if plan.drafts is None else int(decoding.sum())
    longest = int(plan.starts[decoding].max()) + 1 if rows else 0
    return Work(int(plan.counts[d:].sum()) - (rows - d), rows, longest, rows - d)


class StepCost:
    def __init__(self, fixed: float = 5e-3, per_token: float = 5e-5, per_row: float = 1e-4,
                 per_context: float = 2e-7, per_draft_row: float = 1e-4, forgetting: float = 0.98,
                 prior_weight: float = 1.0) -> None:
        """The prior guesses (seconds) matter only for the first steps; `prior_weight` is how many steps'
        worth of evidence they count for. A draft row's guess is a decode row's: drafts are tried, and the fit
        learns what their rows cost on this device (where they cost too much, it stops proposing them until the
        rows' evidence has decayed back towards the guess, and so tries again)."""
        self.prior = np.array([fixed, per_token, per_row, per_context, per_draft_row]) / SCALE
        self.forgetting = forgetting
        self.ridge = prior_weight * np.eye(len(SCALE))
        self.xx = np.zeros((len(SCALE), len(SCALE)))
        self.xy = np.zeros(len(SCALE))
        self.weights = self.prior.copy()
        self._seconds = self._per_unit()
        self.observed = 0
        self._recent: deque[float] = deque(maxlen=256)  # the last steps' seconds, for `cheapest`

    def _per_unit(self) -> tuple[float, ...]:
        # plain floats: the planner asks per row
        return tuple(float(w) for w in self.weights * SCALE)

    def predict(self, work: Work) -> float:
        """Seconds for a step doing `work` (never less than its fixed part)."""
        fixed, token, row, context, draft_row = self._seconds
        return (fixed + token * work.prefill_tokens + row * work.decode_rows
                + context * work.decode_rows * work.decode_longest + draft_row * work.draft_rows)

    def observe(self, work: Work, seconds: float) -> None:
        self._recent.append(seconds)
        if self.observed >= 20:
            # a rare stall (a pool growing, the collector, another process) must not teach the fit that every
            # step is slow: clip it to a few times the prediction; a real slowdown still pulls the fit up fast
            seconds = min(seconds, 3.0 * self.predict(work))
        x = work.features() / max(seconds, 1e-6)  # relative error: each step's row scaled by 1 / its time
        self.xx = self.forgetting * self.xx + np.outer(x, x)
        self.xy = self.forgetting * self.xy + x
        self.weights = _non_negative_solve(self.xx + self.ridge, self.xy + self.ridge @ self.prior)
        self._seconds = self._per_unit()
        self.observed += 1

    @property
    def cheapest(self) -> float:
        """The shortest of the last steps: a bound the fixed part cannot exceed, and a measure of it that no
        fit can bring to zero (the fitted fixed part is the least certain coefficient, near zero when the
        steps' sizes vary together). The fixed part's guess before any step."""
        return min(self._recent, default=float(self.prior[0] * SCALE[0]))

    @property
    def coefficients(self) -> dict[str, float]:
        """The current fit, in seconds: fixed, per prefill token, per decode row, per context token read, per row
        verifying drafts."""
        fixed, token, row, context, draft_row = self._seconds
        return {"step_fixed_s": fixed, "step_per_token_s": token, "step_per_row_s": row, "step_per_context_s": context,
                "step_per_draft_row_s": draft_row}


def _non_negative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares weights of the normal equations `a w = b` with every weight at least zero: a weight
    the free solve puts below zero is fixed at zero and the others solved again. A negative weight would
    promise free work, and clamping it after the solve instead leaves the others fitted to cancel it: with
    decode rows and the context they read rising together, a per-context weight fitted below zero and then
    clamped overestimated every long-context bulk step two to three times, and the planner, trusting it,
    ran bulk work in steps of a third of the size its time limit allowed."""
    free = list(range(len(b)))
    while True:
        w = np.zeros(len(b))
        w[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (w >= 0).all():
            return w
        free.remove(int(np.argmin(w)))

