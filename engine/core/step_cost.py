"""What a step will cost, learned from the steps the engine ran.

A step's time is close to linear in a fixed part, prefill tokens, decode rows and the K/V those rows read
(rows times the longest context: batched decode attention pads to it). The coefficients differ by orders of
magnitude between machines and models, so none is configured: they are fitted online by least squares over
recent steps (older ones decay by `forgetting`, so the fit follows a machine whose speed drifts), pulled
weakly towards a prior until the steps have varied enough. The squares are of relative errors: the decisions
that matter are about small steps, which the many large bulk steps would otherwise outweigh.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from engine.step import StepPlan

# prefill tokens / 1e3, decode rows / 1e2, context tokens / 1e5: weights of similar size, a well-posed fit
SCALE = np.array([1.0, 1e-3, 1e-2, 1e-5])


class Work(NamedTuple):
    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_longest: int = 0  # the longest context among the decode rows

    def features(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_rows, self.decode_rows * self.decode_longest]) * SCALE


def work_of(plan: StepPlan) -> Work:
    """The work of a planned step. A row with drafts is a decode row (it reads its context as one does) and its
    drafts are tokens of compute beside it, as the scheduler planned them."""
    d = plan.num_decodes
    decoding = slice(0, d) if plan.drafts is None else (np.arange(len(plan.counts)) < d) | (plan.drafts > 0)
    rows = d if plan.drafts is None else int(decoding.sum())
    longest = int(plan.starts[decoding].max()) + 1 if rows else 0
    return Work(int(plan.counts[d:].sum()) - (rows - d), rows, longest)


class StepCost:
    def __init__(self, fixed: float = 5e-3, per_token: float = 5e-5, per_row: float = 1e-4,
                 per_context: float = 2e-7, forgetting: float = 0.98, prior_weight: float = 1.0) -> None:
        """The prior guesses (seconds) matter only for the first steps; `prior_weight` is how many steps'
        worth of evidence they count for."""
        self.prior = np.array([fixed, per_token, per_row, per_context]) / SCALE
        self.forgetting = forgetting
        self.ridge = prior_weight * np.eye(4)
        self.xx = np.zeros((4, 4))
        self.xy = np.zeros(4)
        self.weights = self.prior.copy()
        self._seconds = self._per_unit()
        self.observed = 0
        self._recent: deque[float] = deque(maxlen=256)  # the last steps' seconds, for `cheapest`

    def _per_unit(self) -> tuple[float, ...]:
        # a coefficient fitted below zero would promise free work; plain floats: the planner asks per row
        return tuple(float(w) for w in np.maximum(self.weights, 0.0) * SCALE)

    def predict(self, work: Work) -> float:
        """Seconds for a step doing `work` (never less than its fixed part)."""
        fixed, token, row, context = self._seconds
        return (fixed + token * work.prefill_tokens + row * work.decode_rows
                + context * work.decode_rows * work.decode_longest)

    def observe(self, work: Work, seconds: float) -> None:
        self._recent.append(seconds)
        if self.observed >= 20:
            # a rare stall (a pool growing, the collector, another process) must not teach the fit that every
            # step is slow: clip it to a few times the prediction; a real slowdown still pulls the fit up fast
            seconds = min(seconds, 3.0 * self.predict(work))
        x = work.features() / max(seconds, 1e-6)  # relative error: each step's row scaled by 1 / its time
        self.xx = self.forgetting * self.xx + np.outer(x, x)
        self.xy = self.forgetting * self.xy + x
        self.weights = np.linalg.solve(self.xx + self.ridge, self.xy + self.ridge @ self.prior)
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
        """The current fit, in seconds: fixed, per prefill token, per decode row, per context token read."""
        fixed, token, row, context = self._seconds
        return {"step_fixed_s": fixed, "step_per_token_s": token, "step_per_row_s": row, "step_per_context_s": context}
