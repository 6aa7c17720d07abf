"""The statuses of a job and of a batch, and which of them are final."""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"  # its deadline passed before it finished (what it had generated is kept)


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.expired})


class BatchStatus(enum.StrEnum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"  # its completion window ended with items unfinished (those items are `expired`)


BATCH_SETTLED = frozenset({BatchStatus.completed, BatchStatus.failed, BatchStatus.cancelled, BatchStatus.expired})
