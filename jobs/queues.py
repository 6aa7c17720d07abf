"""Queue names and the priority mapping between our scale and the broker's."""

from __future__ import annotations

from jobs.settings import Settings

TASK_RUN_JOB = "convoq.run_job"  # its one argument is the job id; everything else is in the row


def broker_priority(priority: int) -> int:
    """Ours: 9 is the most urgent. Celery's Redis transport serves priority 0 first."""
    return 9 - priority


def queue_for(kind: str, settings: Settings) -> str:
    """Chat replies wait on a person; summaries are offline bulk work on a queue of their own."""
    return settings.bulk_queue if kind == "summarize" else settings.interactive_queue
