"""Token buckets by key (an API key, a client address): a steady rate with room for bursts, kept in this API
process. Buckets that have refilled are forgotten once there are many, so the table stays bounded."""

from __future__ import annotations

import threading
import time

MAX_BUCKETS = 100_000


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self._lock = threading.Lock()

    def _tokens(self, key: str, now: float) -> float:
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def take(self, key: str) -> float:
        """0 if the request may go ahead (a token taken), else the seconds until it could."""
        with self._lock:
            now = time.monotonic()
            tokens = self._tokens(key, now)
            if len(self._buckets) >= MAX_BUCKETS and key not in self._buckets:
                self._forget_full(now)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        """A bucket that has refilled is the same as no bucket."""
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.burst]:
            del self._buckets[key]
