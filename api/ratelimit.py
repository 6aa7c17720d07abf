"""Per-key token buckets: a steady rate with room for bursts, kept in this API process."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0 if the request may go ahead, else the seconds until it could."""
        with self._lock:
            now = time.monotonic()
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate
