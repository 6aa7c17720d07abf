"""The liveness rule of workers: a worker lives while it beats within a lease and has not stopped.

The router places conversations on live workers only, the health probe counts them, and the sweep marks the
others stopped: all three ask `alive`, so that no worker is live to one and gone to another.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from jobs.tables import Worker
from store.clock import db_now


def alive(dead_after_s: float) -> ColumnElement[bool]:
    """A `workers` row that beat within `dead_after_s` (on the database's clock) and has not stopped."""
    workers = Worker.__table__.c
    return workers.stopped_at.is_(None) & (workers.heartbeat_at >= db_now(-dead_after_s))


def live_workers(session: Session, dead_after_s: float) -> list[str]:
    """The names of the live workers, in order."""
    workers = Worker.__table__.c
    return list(session.scalars(select(workers.name).where(alive(dead_after_s)).order_by(workers.name)))
