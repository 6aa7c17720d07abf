"""Whether the database and the broker answer, and how many workers are alive."""

from __future__ import annotations

from celery import Celery
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from jobs.clock import db_now
from jobs.settings import Settings
from jobs.tables import Worker


def checks(session: Session, celery: Celery) -> dict[str, str]:
    """`database` and `broker`: "ok", or "error: " and the exception's type."""
    found = {}
    try:
        session.execute(text("SELECT 1"))
        found["database"] = "ok"
    except Exception as exc:
        found["database"] = f"error: {type(exc).__name__}"
    try:
        with celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        found["broker"] = "ok"
    except Exception as exc:
        found["broker"] = f"error: {type(exc).__name__}"
    return found


def workers_alive(session: Session, settings: Settings) -> int:
    """Workers whose heartbeat is within CONVOQ_DEAD_AFTER_S and that have not stopped."""
    alive = db_now(-settings.dead_after_s)  # heartbeats are stamped on the database's clock
    return session.scalar(
        select(func.count()).select_from(Worker).where(Worker.heartbeat_at >= alive, Worker.stopped_at.is_(None)))
