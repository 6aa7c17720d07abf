"""The leases one worker process holds (job id -> lease id). Its heartbeat renews exactly these.

A job the worker does not hold in memory is not renewed, even if its row names this worker (a claim whose
reply was lost, say). Its lease expires and the reconciler hands it back.
"""

from __future__ import annotations

import threading
import uuid

from worker.fence import Claimed


class Leases:
    def __init__(self) -> None:
        self._held: dict[uuid.UUID, Claimed] = {}
        self._lock = threading.Lock()

    def add(self, claimed: Claimed) -> None:
        with self._lock:
            self._held[claimed.job_id] = claimed

    def drop(self, claimed: Claimed) -> None:
        """Forget this claim's lease; a later claim of the same job (handed back, then taken again here) stays."""
        with self._lock:
            if self._held.get(claimed.job_id) is claimed:
                del self._held[claimed.job_id]

    def held(self) -> dict[uuid.UUID, uuid.UUID]:
        """Job id -> lease id."""
        with self._lock:
            return {job_id: claimed.lease for job_id, claimed in self._held.items()}

    def claims(self) -> list[Claimed]:
        with self._lock:
            return list(self._held.values())
