"""Task and queue names, and the one rule that tells interactive work from bulk work."""

from __future__ import annotations

from jobs.settings import Settings

TASK_RUN_JOB = "convoq.run_job"  # its one argument is the job id; everything else is in the row
TASK_RUN_GROUP = "convoq.run_group"  # its one argument is a list of job ids: lines of one batch (`broker.publish`)


def is_interactive(priority: int, settings: Settings) -> bool:
    """Whether a person waits on a job of this priority: the one line between interactive and bulk work, drawn
    here for every stage (its queue, the worker's threads, the engine's latency targets, the report)."""
    return priority >= settings.interactive_priority


def queue_for(priority: int, settings: Settings) -> str:
    """Interactive jobs and bulk jobs travel apart, so that a worker full of bulk work still fetches the next
    interactive message (see `worker.bulk_gate`)."""
    return settings.interactive_queue if is_interactive(priority, settings) else settings.bulk_queue


HOME_SEP = "@"


def home_tag(worker: str) -> str:
    """The part of a worker's own queues that names it (its `workers` row's name): no ':' in it, which separates
    a queue from its priority lists in Redis."""
    return worker.replace(":", ".")


def home_queue(queue: str, worker: str) -> str:
    """The queue of `queue`'s class that only the worker named `worker` consumes (`broker.affinity`)."""
    return f"{queue}{HOME_SEP}{home_tag(worker)}"
