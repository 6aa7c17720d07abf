"""Backpressure: a bound on unfinished jobs per API key and overall, checked before anything is stored.

Counting every unfinished job on every submission would cost more as the queue grows, so a count reads at
most `bound + 1` index entries and is kept for `ttl` seconds; what this process admits meanwhile is added
to it at once. Jobs that finish meanwhile are noticed at the next count, so the bound errs on the safe
side. Several API processes each add only their own admissions between counts, so together they can
overshoot a bound by what they admit within `ttl`.
"""

from __future__ import annotations

import threading
import time

from fastapi import HTTPException, status
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from jobs.settings import Settings
from jobs.status import JobStatus
from jobs.tables import Job

UNFINISHED = (JobStatus.queued.value, JobStatus.running.value)
EVERYONE = None


class Busy(HTTPException):
    def __init__(self, detail: str, retry_after_s: int) -> None:
        super().__init__(status.HTTP_429_TOO_MANY_REQUESTS, detail, headers={"Retry-After": str(retry_after_s)})


class Admission:
    def __init__(self, settings: Settings, ttl: float = 1.0) -> None:
        self.per_key = settings.max_queued_per_key
        self.total = settings.max_queued
        self.retry_after_s = settings.busy_retry_after_s
        self.ttl = ttl
        self._counts: dict[str | None, tuple[float, int]] = {}  # owner (None: everyone) -> (counted at, count)
        self._lock = threading.Lock()

    def admit(self, session: Session, owner: str, n: int) -> None:
        """Take `n` more unfinished jobs for `owner`, or raise `Busy` (429) and take none."""
        with self._lock:
            bounds = [(o, b) for o, b in ((owner, self.per_key), (EVERYONE, self.total)) if b > 0]
            counts = {o: self._count(session, o, b) for o, b in bounds}
            for o, bound in bounds:
                if counts[o] + n > bound:
                    whose = "this API key" if o is not EVERYONE else "the service"
                    raise Busy(f"{whose} has {counts[o]} unfinished jobs; {n} more would pass the bound of {bound}; "
                               "retry later", self.retry_after_s)
            for o, _ in bounds:
                at, count = self._counts[o]
                self._counts[o] = (at, count + n)

    def give_back(self, owner: str, n: int) -> None:
        """`n` admitted jobs were not stored after all (an idempotent repeat, a failed insert)."""
        with self._lock:
            for o in (owner, EVERYONE):
                if o in self._counts:
                    at, count = self._counts[o]
                    self._counts[o] = (at, max(0, count - n))

    def unfinished(self, session: Session) -> int | None:
        """Unfinished jobs overall, as the bound sees them (None when there is no overall bound)."""
        if self.total <= 0:
            return None
        with self._lock:
            return self._count(session, EVERYONE, self.total)

    def _count(self, session: Session, owner: str | None, bound: int) -> int:
        now = time.monotonic()
        cached = self._counts.get(owner)
        if cached is not None and now - cached[0] < self.ttl:
            return cached[1]
        rows = select(Job.id).where(Job.status.in_(UNFINISHED))
        if owner is not EVERYONE:
            rows = rows.where(Job.owner == owner)
        count = session.scalar(select(func.count()).select_from(rows.limit(bound + 1).subquery()))
        self._counts[owner] = (now, count)
        return count
