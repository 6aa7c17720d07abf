"""The leases one worker process holds (job id -> lease id): its heartbeat renews exactly these.

A job the worker does not hold in memory is not renewed, even if its row names this worker (a claim whose
reply was lost, say): its lease expires and the reconciler hands it back.
"""

from __future__ import annotations

import threading
import uuid

from worker.results import Claimed


class Leases:
    def __init__(self) -> None:
        self._held: dict[uuid.UUID, uuid.UUID] = {}
        self._lock = threading.Lock()

    def add(self, claimed: Claimed) -> None:
        with self._lock:
            self._held[claimed.job_id] = claimed.lease

    def drop(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._held.pop(job_id, None)

    def held(self) -> dict[uuid.UUID, uuid.UUID]:
        with self._lock:
            return dict(self._held)
