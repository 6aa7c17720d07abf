"""What happened to a set of jobs, counted from what the service recorded: every check here can fail.

- `executions`: runs of the jobs (`runs`: one per claim); `duplicate_executions`: runs beyond the first that no
  earlier run's end explains (a run ends `crashed` when its lease expired, `returned` at a clean shutdown,
  `retry` after an error: each of those is a reason to run again; anything else is a second run of a job
  that did not need one);
- `duplicate_results`: jobs whose result was written by more than one run (a fenced write makes this 0);
- `stale_writes_refused`: writes refused because their run had lost the lease;
- `stuck`: jobs not in a terminal status; `lost`: accepted jobs with no row, or stuck queued with no message
  in the broker and none running them.
"""

from __future__ import annotations

import uuid

import redis
import sqlalchemy as sa

from jobs.broker import UNACKED_KEY, job_id_of, message_headers, queue_lists
from jobs.schemas import TERMINAL, JobStatus
from jobs.settings import Settings
from jobs.tables import Job, Run

RERUN_REASONS = ("crashed", "returned", "retry")


def messages_by_job(client: redis.Redis, settings: Settings) -> dict[uuid.UUID, list[tuple[str, bytes]]]:
    """Every message in the broker for each job: (queue list or `unacked`, raw message)."""
    found: dict[uuid.UUID, list[tuple[str, bytes]]] = {}
    for name in (n for names in queue_lists(settings).values() for n in names):
        for raw in client.lrange(name, 0, -1):
            if (job_id := job_id_of(message_headers(raw))) is not None:
                found.setdefault(job_id, []).append((name, raw))
    for raw in client.hvals(UNACKED_KEY):
        if (job_id := job_id_of(message_headers(raw))) is not None:
            found.setdefault(job_id, []).append((UNACKED_KEY, raw))
    return found


def audit(db: sa.Engine, ids: list[uuid.UUID], broker: redis.Redis | None = None,
          settings: Settings | None = None) -> dict[str, int]:
    """Counts for the jobs `ids` (see the module's doc); `lost` looks into the broker when one is given."""
    runs = Run.__table__
    out: dict[str, int] = {"submitted": len(ids)}
    with db.connect() as conn:
        status = dict(conn.execute(sa.select(Job.id, Job.status).where(Job.id.in_(ids))).all())
        per_job = conn.execute(
            sa.select(runs.c.job_id, sa.func.count(),
                      sa.func.count().filter(runs.c.outcome.in_(RERUN_REASONS)),
                      sa.func.count().filter(runs.c.outcome == JobStatus.succeeded.value),
                      sa.func.coalesce(sa.func.sum(runs.c.stale_writes), 0))
            .where(runs.c.job_id.in_(ids)).group_by(runs.c.job_id)
        ).all()
    for s in JobStatus:
        out[s.value] = sum(1 for v in status.values() if v == s.value)
    out["executions"] = sum(n for _, n, *_ in per_job)
    out["duplicate_executions"] = sum(max(0, n - 1 - explained) for _, n, explained, *_ in per_job)
    out["duplicate_results"] = sum(1 for *_, stored, _ in per_job if stored > 1)
    out["stale_writes_refused"] = int(sum(stale for *_, stale in per_job))
    terminal = {s.value for s in TERMINAL}
    stuck = [i for i, s in status.items() if s not in terminal]
    out["stuck"] = len(stuck)
    out["lost"] = len(ids) - len(status)
    if broker is not None and settings is not None:
        present = set(messages_by_job(broker, settings))
        out["lost"] += sum(1 for i in stuck if status[i] == JobStatus.queued.value and i not in present)
    return out
