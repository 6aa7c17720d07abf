"""Queue names and the priority mapping between our scale and the broker's."""

from __future__ import annotations

from jobs.settings import Settings

TASK_RUN_JOB = "convoq.run_job"  # its one argument is the job id; everything else is in the row


def broker_priority(priority: int) -> int:
    """Ours: 9 is the most urgent. Celery's Redis transport serves priority 0 first."""
    return 9 - priority


def queue_for(priority: int, settings: Settings) -> str:
    """Interactive jobs (a person waits on them) and bulk jobs travel apart, so that a worker full of bulk work
    still fetches the next interactive message (see `worker.bulk_gate`); the engine draws the same line."""
    return settings.interactive_queue if priority >= settings.interactive_priority else settings.bulk_queue
