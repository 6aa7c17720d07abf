"""What happened to a set of jobs, counted from what the service recorded: every check here can fail.

- `executions`: runs of the jobs (`runs`: one per claim); `duplicate_executions`: runs beyond the first that no
  earlier run's end explains (a run ends `crashed` when its lease expired, `returned` at a clean shutdown,
  `retry` after an error, `stalled` when its engine stalled and was killed: each of those is a reason to run
  again; anything else is a second run of a job that did not need one);
- `crashes_uncaused`: jobs charged more crashes (`jobs.crashes`) than their runs explain: one per run that ended
  with its worker's death (`crashed`, `condemned`; with `dead_workers` given, only on those workers), one per
  stalled run after the first, or one for a stalled run that ran alone (it condemns the job);
- `duplicate_results`: jobs whose result was written by more than one run (a fenced write makes this 0);
- `stale_writes_refused`: writes refused because their run had lost the lease;
- `stuck`: jobs not in a terminal status; `lost`: accepted jobs with no row, or stuck queued with no message
  in the broker and none running them.
"""

from __future__ import annotations

import uuid

import redis
import sqlalchemy as sa

from broker.redis_layout import UNACKED_KEY, queue_lists
from broker.view import job_ids_of, message_headers
from jobs.settings import Settings
from jobs.status import TERMINAL, JobStatus
from jobs.tables import Job, Run

RERUN_REASONS = ("crashed", "returned", "retry", "stalled")
DEATHS = ("crashed", "condemned")  # a run's lease expired: its worker is taken for dead


def messages_by_job(client: redis.Redis, settings: Settings) -> dict[uuid.UUID, list[tuple[str, bytes]]]:
    """Every message in the broker for each job: (queue list or `unacked`, raw message)."""
    found: dict[uuid.UUID, list[tuple[str, bytes]]] = {}
    for name in (n for names in queue_lists(settings).values() for n in names):
        for raw in client.lrange(name, 0, -1):
            for job_id in job_ids_of(message_headers(raw)):
                found.setdefault(job_id, []).append((name, raw))
    for raw in client.hvals(UNACKED_KEY):
        for job_id in job_ids_of(message_headers(raw)):
            found.setdefault(job_id, []).append((UNACKED_KEY, raw))
    return found


def audit(db: sa.Engine, ids: list[uuid.UUID], broker: redis.Redis | None = None,
          settings: Settings | None = None, dead_workers: set[int] | None = None) -> dict[str, int]:
    """Counts for the jobs `ids` (see the module's doc); `lost` looks into the broker when one is given;
    `dead_workers`: the pids of the worker processes that really died (or froze past their leases), when known."""
    runs = Run.__table__
    out: dict[str, int] = {"submitted": len(ids)}
    died = runs.c.outcome.in_(DEATHS)
    if dead_workers is not None:  # worker names are host:pid:start
        died &= sa.or_(sa.false(), *(runs.c.worker.like(f"%:{pid}:%") for pid in dead_workers))
    with db.connect() as conn:
        rows = conn.execute(sa.select(Job.id, Job.status, Job.crashes).where(Job.id.in_(ids))).all()
        per_job = conn.execute(
            sa.select(runs.c.job_id, sa.func.count(),
                      sa.func.count().filter(runs.c.outcome.in_(RERUN_REASONS)),
                      sa.func.count().filter(runs.c.outcome == JobStatus.succeeded.value),
                      sa.func.coalesce(sa.func.sum(runs.c.stale_writes), 0),
                      sa.func.count().filter(died), sa.func.count().filter(runs.c.outcome == "stalled"),
                      sa.func.count().filter((runs.c.outcome == "stalled") & runs.c.alone))
            .where(runs.c.job_id.in_(ids)).group_by(runs.c.job_id)
        ).all()
    status = {job_id: s for job_id, s, _ in rows}
    for s in JobStatus:
        out[s.value] = sum(1 for v in status.values() if v == s.value)
    out["executions"] = sum(n for _, n, *_ in per_job)
    out["duplicate_executions"] = sum(max(0, n - 1 - explained) for _, n, explained, *_ in per_job)
    out["duplicate_results"] = sum(1 for _, _, _, stored, *_ in per_job if stored > 1)
    out["stale_writes_refused"] = int(sum(stale for *_, stale, _, _, _ in per_job))
    charges = {job_id: deaths + max(stalls - 1, alone) for job_id, *_, deaths, stalls, alone in per_job}
    out["crashes_uncaused"] = sum(1 for job_id, _, crashes in rows if crashes > charges.get(job_id, 0))
    terminal = {s.value for s in TERMINAL}
    stuck = [i for i, s in status.items() if s not in terminal]
    out["stuck"] = len(stuck)
    out["lost"] = len(ids) - len(status)
    if broker is not None and settings is not None:
        present = set(messages_by_job(broker, settings))
        out["lost"] += sum(1 for i in stuck if status[i] == JobStatus.queued.value and i not in present)
    return out
