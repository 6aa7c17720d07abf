"""Database engine and sessions, plus the one idempotent write everything else builds on."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Engine, QueuePool, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
# deadlock_detected, serialization_failure: PostgreSQL aborted the transaction to let another one through
CONFLICTS = ("40P01", "40001")


def make_db_engine(url: str, pool_size: int = 16, pre_ping: bool = True,
                   pool_class: type[QueuePool] = QueuePool) -> Engine:
    """`pre_ping` costs a round trip per checkout; callers that retry on a dropped connection turn it off.
    `pool_class`: a QueuePool of the caller's (the API counts its waits for a connection); not for SQLite."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record) -> None:
            # WAL lets the API read while the worker writes; foreign keys are off by default in SQLite
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")

        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=pre_ping,
                         poolclass=pool_class)


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def insert_ignore(session: Session, table, rows: dict | list[dict]) -> None:
    """INSERT ... ON CONFLICT DO NOTHING: at-least-once delivery may write the same row twice.

    One statement run for every row (executemany), so its compiled form is cached whatever the row count."""
    dialect = session.get_bind().dialect.name
    insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}[dialect]
    session.connection().execute(insert(table.__table__).on_conflict_do_nothing(), rows)


def conflicted(exc: DBAPIError) -> bool:
    """The database aborted this transaction to break a deadlock or a serialization conflict."""
    return getattr(exc.orig, "sqlstate", None) in CONFLICTS


def retry_conflicts(session: Session, action: Callable[[], T], attempts: int = 5) -> T:
    """Run `action` (one transaction on `session`, which it commits) again when the database aborted it for a
    conflict with another transaction: nothing of it was applied, so it is safe to run again. Any other error
    is raised at once."""
    for attempt in range(attempts - 1):
        try:
            return action()
        except DBAPIError as exc:
            session.rollback()
            if not conflicted(exc):
                raise
            time.sleep(random.uniform(0.01, 0.05) * 2**attempt)  # apart, so the two do not meet again
    return action()
