"""A worker's heartbeat, and its row in `workers`.

Each worker beats once per `heartbeat_s`, in one transaction. The beat stamps its `workers` row, renews the
leases of the jobs it holds and asks whether a sweep is due, so its cost is constant per worker. A worker that
stops cleanly hands its jobs back, and one whose shutdown has begun says it is draining.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field

from sqlalchemy import Row, case, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Advert
from jobs.tables import Job, Sweep, Worker, utcnow
from store.clock import db_now
from store.writes import insert_ignore
from worker.fence import RUNNING, end_runs
from worker.run_ends import returned_columns
from worker.sweep import SWEEP


@dataclass
class Beat:
    """What one heartbeat learned: whether a sweep is due, and, among the jobs this worker holds, those lost
    (their lease moved on) and those whose cancel was asked for."""

    sweep_due: bool
    lost: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def usage_columns(usage: tuple[float, int] | None) -> dict:
    """A worker row's columns for its `usage` (CPU seconds, jobs finished); none when there is none."""
    return {} if usage is None else dict(cpu_s=usage[0], jobs_finished=usage[1])


def beat(sessions: sessionmaker[Session], name: str, leases: dict[uuid.UUID, uuid.UUID], lease_s: float,
         sweep_every_s: float, usage: tuple[float, int] | None = None, advert: Advert | None = None) -> Beat:
    """Stamp this worker alive and renew the leases it holds (job id -> lease id), in one transaction; with its
    `usage` so far (CPU seconds, jobs finished: `Worker.cpu_s`, `Worker.jobs_finished`) and its `advert` (the
    classes it consumes and whether it takes conversations, which the router reads)."""
    used = usage_columns(usage) | (advert.columns() if advert is not None else {})
    workers, jobs, sweeps = Worker.__table__, Job.__table__, Sweep.__table__
    swept_at = select(sweeps.c.swept_at).where(sweeps.c.name == SWEEP).scalar_subquery()
    due = case((swept_at.is_(None), True), (swept_at < db_now(-sweep_every_s), True), else_=False)
    with sessions.begin() as session:
        row = session.execute(update(workers).where(workers.c.name == name)
                              .values(heartbeat_at=db_now(), stopped_at=None, **used).returning(due)).first()
        if row is None:  # first beat (or the row was pruned while this worker was cut off)
            now = utcnow()
            insert_ignore(session, Worker, dict(name=name, hostname=socket.gethostname(), pid=os.getpid(),
                                                 started_at=now, heartbeat_at=now, **used))
        renewed: list[Row] = []
        if leases:
            renewed = session.execute(
                # An expired lease is renewed too while its job still runs under it. It expired while this worker
                # lived (the database was away, or the worker froze), and nobody else has the job. Once a sweep
                # hands the job back its lease id is gone, so is the renewal, and every late write of the run
                # is refused (`fence.holds`).
                update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING,
                                   jobs.c.lease_id.in_(set(leases.values())))
                .values(lease_expires_at=db_now(lease_s))
                .returning(jobs.c.id, jobs.c.cancel_requested_at)
            ).all()
    held = {job_id for job_id, _ in renewed}
    return Beat(sweep_due=row is None or bool(row[0]),
                lost=[str(i) for i in leases if i not in held],
                cancelled=[str(i) for i, asked in renewed if asked is not None])


def hand_back(sessions: sessionmaker[Session], name: str, usage: tuple[float, int] | None = None) -> int:
    """A worker stopping cleanly returns the jobs it still holds, uncharged; a sweep sends them again. Its row
    says it stopped, with its last `usage` (as `beat` stamps it)."""
    used = usage_columns(usage)
    jobs = Job.__table__
    with sessions.begin() as session:
        back = session.execute(
            update(jobs).where(jobs.c.worker == name, jobs.c.status == RUNNING)
            .values(**returned_columns(), lease_id=None)
            .returning(jobs.c.id, jobs.c.lease_id)
        ).all()
        end_runs(session, [(job_id, lease, "returned") for job_id, lease in back])
        session.execute(update(Worker.__table__).where(Worker.name == name).values(stopped_at=db_now(), **used))
    return len(back)


def mark_draining(sessions: sessionmaker[Session], name: str) -> None:
    """This worker's shutdown has begun: from now on the router places no conversation on it (`broker.affinity`),
    and the sweep moves whatever is sent to its own queues regardless to the shared ones."""
    with sessions.begin() as session:
        session.execute(update(Worker.__table__).where(Worker.name == name, Worker.draining_at.is_(None))
                        .values(draining_at=db_now()))
