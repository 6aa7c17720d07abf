"""Whether the database and the broker answer, and how many workers are alive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
from celery import Celery
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from jobs.settings import Settings
from store.workers import live_workers

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
        self._lock = threading.Lock()  # one probe at a time; the others answer with the last one's findings

    def checks(self) -> dict[str, str]:
        """`database` and `broker`: "ok", or "error: " and the exception's type. While a probe hangs (a
        dependency that neither answers nor refuses), callers get the last findings instead of each waiting on
        it and holding a thread: only the very first callers wait."""
        if time.monotonic() - self._at < self.ttl or not self._lock.acquire(blocking=not self._found):
            return dict(self._found)
        try:
            if time.monotonic() - self._at >= self.ttl:
                self._found = {"database": _outcome(self._database), "broker": _outcome(self._broker)}
                self._at = time.monotonic()
            return dict(self._found)
        finally:
            self._lock.release()

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
    return len(live_workers(session, settings.dead_after_s))
