"""Whether the database and the broker answer, and how many workers are alive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
from celery import Celery
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from jobs.clock import db_now
from jobs.settings import Settings
from jobs.tables import Worker

PROBE_TTL_S = 2.0


class Probe:
    """The database and the broker asked at most once per `ttl` seconds, over pooled connections, however
    often it is called: `/healthz` and `/readyz` need no key, so a flood of them must not cost a connection
    each. `broker` is the API's Redis client for a Redis broker, None for another transport (asked through
    Celery then)."""

    def __init__(self, sessions: sessionmaker[Session], celery: Celery, broker: redis.Redis | None,
                 ttl: float = PROBE_TTL_S) -> None:
        self.sessions = sessions
        self.celery = celery
        self.broker = broker
        self.ttl = ttl
        self._found: dict[str, str] = {}
        self._at = float("-inf")
        self._lock = threading.Lock()  # callers that find it stale wait for one probe, not one each

    def checks(self) -> dict[str, str]:
        """`database` and `broker`: "ok", or "error: " and the exception's type."""
        with self._lock:
            if time.monotonic() - self._at >= self.ttl:
                self._found = {"database": _outcome(self._database), "broker": _outcome(self._broker)}
                self._at = time.monotonic()
            return dict(self._found)

    def _database(self) -> None:
        with self.sessions() as session:
            session.execute(text("SELECT 1"))

    def _broker(self) -> None:
        if self.broker is not None:
            self.broker.ping()
            return
        with self.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)


def _outcome(check: Callable[[], None]) -> str:
    try:
        check()
    except Exception as exc:
        return f"error: {type(exc).__name__}"
    return "ok"


def workers_alive(session: Session, settings: Settings) -> int:
    """Workers whose heartbeat is within CONVOQ_DEAD_AFTER_S and that have not stopped."""
    alive = db_now(-settings.dead_after_s)  # heartbeats are stamped on the database's clock
    return session.scalar(
        select(func.count()).select_from(Worker).where(Worker.heartbeat_at >= alive, Worker.stopped_at.is_(None)))
