"""The writes everything else builds on: idempotent inserts (at-least-once delivery writes a row twice), and a
transaction run again when the database aborted it for a conflict.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import JSON, Column, MetaData, Table, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import Insert

T = TypeVar("T")
# deadlock_detected, serialization_failure: PostgreSQL aborted the transaction to let another one through
CONFLICTS = ("40P01", "40001")


def insert_ignore(session: Session, table, rows: dict | list[dict], **same: object) -> None:
    """INSERT ... ON CONFLICT DO NOTHING: at-least-once delivery may write the same row twice. `same`: columns
    every row takes from one SQL expression (the database's clock, say).

    One statement run for every row (executemany), so its compiled form is cached whatever the row count."""
    dialect = session.get_bind().dialect.name
    statement = _insert_ignore(dialect, table)
    session.connection().execute(statement.values(**same) if same else statement, rows)


_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


@functools.cache
def _insert_ignore(dialect: str, table) -> Insert:
    """`insert_ignore`'s statement, built once: the workers' claims and stores run it for every job, and building
    and keying a statement costs more CPU than sending it."""
    return _INSERTS[dialect](table.__table__).on_conflict_do_nothing()


def copy_ignore(session: Session, table, rows: list[dict], **same: object) -> None:
    """`insert_ignore` for many rows through COPY on PostgreSQL, at about half the cost per row: copied into a
    temporary table shaped like `table`, then inserted from there ON CONFLICT DO NOTHING in one statement. A column
    the rows leave out takes its scalar default (`status`, `attempts`), as an INSERT through SQLAlchemy would.
    SQLite has no COPY: there it is `insert_ignore`."""
    if session.get_bind().dialect.name != "postgresql" or not rows:
        insert_ignore(session, table, rows, **same)
        return
    from psycopg.types.json import Json  # PostgreSQL's driver: not needed on SQLite

    target = table.__table__
    defaults = {c.name: c.default.arg for c in target.columns
                if c.default is not None and c.default.is_scalar and c.name not in rows[0]}
    names = [c.name for c in target.columns if c.name in rows[0]] + list(defaults)
    json = {c.name for c in target.columns if isinstance(c.type, JSON)}
    staging = Table(f"copy_{target.name}", MetaData(), *(Column(n, target.c[n].type) for n in names))
    session.execute(text(f"CREATE TEMPORARY TABLE IF NOT EXISTS {staging.name} "
                         f"(LIKE {target.name} INCLUDING DEFAULTS) ON COMMIT DROP"))
    with session.connection().connection.driver_connection.cursor() as cursor, \
            cursor.copy(f"COPY {staging.name} ({', '.join(names)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([Json(value) if name in json and value is not None else value
                            for name, value in ((n, row.get(n, defaults.get(n))) for n in names)])
    session.execute(postgresql.insert(target).from_select(
        names + list(same), select(*staging.c, *same.values())).on_conflict_do_nothing())
    session.execute(text(f"TRUNCATE {staging.name}"))  # the next rows of this transaction go in alone


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
