"""The database's clock: leases, heartbeats and deadlines are stamped and compared on it alone.

A thousand workers have a thousand clocks; a lease judged on the clock of the host that reads it expires early
or late by their skew. Every time comparison that decides who owns a job is written with `db_now()` and runs
inside the database, on one clock.
"""

from __future__ import annotations

from sqlalchemy import DateTime, literal
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement):
    """The database's current time plus `seconds` (which may be negative)."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_now"

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(literal(float(seconds)))


@compiles(db_now)
def _postgresql(element: db_now, compiler, **kw) -> str:
    # now() is the transaction's start: one instant for every row a statement touches
    return f"(now() + {compiler.process(element.clauses, **kw)} * interval '1 second')"


@compiles(db_now, "sqlite")
def _sqlite(element: db_now, compiler, **kw) -> str:
    # the text form SQLAlchemy stores SQLite datetimes in, so that comparisons with stored values are exact
    seconds = compiler.process(element.clauses, **kw)
    return f"strftime('%Y-%m-%d %H:%M:%f000', 'now', ({seconds}) || ' seconds')"
