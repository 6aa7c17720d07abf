"""One SQL statement run on a test database in its own transaction, for setting up and reading back rows."""

from __future__ import annotations

import sqlalchemy as sa


def sql(database: str, statement: str, **params) -> list:
    """The rows `statement` returns (none for a write), committed on a connection of its own."""
    engine = sa.create_engine(database)
    with engine.begin() as conn:
        result = conn.execute(sa.text(statement), params)
        rows = result.all() if result.returns_rows else []
    engine.dispose()
    return rows
