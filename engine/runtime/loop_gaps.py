"""How long the step loop leaves the model idle between two steps it runs back to back.

On a GPU a step takes milliseconds, and whatever the host does between the end of one step and the start of
the next (taking in requests, resolving futures, waiting for the interpreter lock that other threads hold)
is time the device sits idle. The gaps go into fixed log-spaced buckets, so memory stays bounded however
long the loop runs, and a percentile comes back within one bucket's width (about 9%).
"""

from __future__ import annotations

import math

FIRST = 1e-6  # seconds: the lowest bucket's upper edge
PER_DOUBLING = 8  # buckets per doubling of the gap
BUCKETS = 8 * 24  # up to about 16 s; longer gaps fall in the last bucket


class LoopGaps:
    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.total = 0
        self.step_ended: float | None = None  # when the last step ended, while the loop had more to run

    def observe(self, seconds: float) -> None:
        bucket = 0 if seconds <= FIRST else math.ceil(PER_DOUBLING * math.log2(seconds / FIRST))
        self.counts[min(bucket, BUCKETS - 1)] += 1
        self.total += 1

    def percentile(self, q: float) -> float:
        """Seconds below which a fraction `q` of the gaps fall (each bucket's upper edge); 0 with none seen."""
        if not self.total:
            return 0.0
        rank, seen = q * self.total, 0
        for bucket, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return FIRST * 2 ** (bucket / PER_DOUBLING)
        return FIRST * 2 ** ((BUCKETS - 1) / PER_DOUBLING)
