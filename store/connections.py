"""Database engines and sessions: a ping only for pooled connections left idle, SQLite's pragmas."""

from __future__ import annotations

import math
import time

from sqlalchemy import Engine, QueuePool, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

# when a pooled connection was last checked in (`_ping_when_idle`)
IDLE_SINCE = "convoq_idle_since"


def make_db_engine(url: str, pool_size: int = 16, ping_idle_s: float | None = 2.0,
                   pool_class: type[QueuePool] = QueuePool, idle_in_transaction_s: float | None = None) -> Engine:
    """`ping_idle_s`: a pooled connection idle longer than this is pinged as it is checked out, and replaced if
    the server dropped it (`_ping_when_idle`); None: never (callers that retry on a dropped connection).
    `pool_class`: a QueuePool of the caller's (the API counts its waits for a connection); not for SQLite.
    `idle_in_transaction_s`: PostgreSQL ends a session that sits this long inside a transaction
    (`idle_in_transaction_session_timeout`), and the locks it holds with it; None: never.

    A statement's parameters are left out of its errors (`hide_parameters`): they hold tenants' prompts and
    results, and an error's text goes to logs and to a failed job's `error_detail`."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record) -> None:
            # WAL lets the API read while the worker writes; foreign keys are off by default in SQLite
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA synchronous=NORMAL")

        return engine
    options = {} if idle_in_transaction_s is None else {
        "options": f"-c idle_in_transaction_session_timeout={max(1, round(idle_in_transaction_s * 1000))}"}
    engine = create_engine(url, pool_size=pool_size, max_overflow=pool_size, poolclass=pool_class,
                           hide_parameters=True, connect_args=options)
    if ping_idle_s is not None:
        _ping_when_idle(engine, ping_idle_s)
    return engine


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """SQLAlchemy's `pool_pre_ping` pings at every checkout: a round trip and a statement for every request of a
    busy API, on connections that were in use a moment ago. Here only a connection idle for `idle_s` is pinged,
    the one a server restart or an idle timeout can have dropped unseen; a dropped one is replaced before the
    caller gets it (the pool connects again on a `DisconnectionError`)."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_connection, record) -> None:
        record.info[IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_connection, record, _proxy) -> None:
        if time.monotonic() - record.info.get(IDLE_SINCE, math.inf) <= idle_s:
            return  # in use a moment ago, or new (`record.info` goes with the DBAPI connection it holds)
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"a pooled connection idle for over {idle_s} s was dropped: {exc}") from exc


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
