"""Jobs and batches by status without counting the tables: triggers append deltas, a reader folds them.

Why triggers appending deltas: a scrape must not scan a table that holds every job ever kept, and a count
maintained in application code is one any new write path can forget (the API, the worker, the reconciler,
retention and raw SQL all change statuses). Triggers see every change, in the transaction that makes it.
They *append* +1/-1 rows instead of updating one row per status: a shared counter row would be
locked by every submission, claim and store until its commit, serializing them all and deadlocking
transactions that move jobs in opposite directions (queued -> running against running -> queued).
Appends never wait on each other. `fold` turns the deltas back into one row per status; the reconciler's sweep
folds every `sweep_every_s` and retention after every prune, so the table stays a handful of rows plus the
changes since. `/metrics` only reads (a scrape needs no key, so it must not write).

Inserts and deletes are counted per statement on PostgreSQL (a batch upload or a prune chunk adds one row per
status, not per job); updates per row, and only when the status changed (a `published_at` stamp adds
nothing). SQLite has no statement triggers: there every row adds its own delta.

A SQLite migration that rebuilds `jobs` or `batches` (Alembic's batch mode) drops their triggers: it must
`install` them again. `tests/test_counts.py` checks the migrated schema counts on both databases.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import Connection, delete, func, insert, select, text
from sqlalchemy.orm import Session

from jobs.tables import status_counts

COUNTED = ("jobs", "batches")

POSTGRES_FUNCTIONS = [
    """CREATE FUNCTION convoq_count_statement() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO status_counts (table_name, status, n)
            SELECT TG_TABLE_NAME, status, count(*) FROM added GROUP BY status;
        ELSE
            INSERT INTO status_counts (table_name, status, n)
            SELECT TG_TABLE_NAME, status, -count(*) FROM removed GROUP BY status;
        END IF;
        RETURN NULL;
    END $$""",
    """CREATE FUNCTION convoq_count_update() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO status_counts (table_name, status, n)
        VALUES (TG_TABLE_NAME, OLD.status, -1), (TG_TABLE_NAME, NEW.status, 1);
        RETURN NULL;
    END $$""",
]


def _postgres_triggers(table: str) -> list[str]:
    return [
        f"CREATE TRIGGER {table}_count_insert AFTER INSERT ON {table} REFERENCING NEW TABLE AS added "
        "FOR EACH STATEMENT EXECUTE FUNCTION convoq_count_statement()",
        f"CREATE TRIGGER {table}_count_delete AFTER DELETE ON {table} REFERENCING OLD TABLE AS removed "
        "FOR EACH STATEMENT EXECUTE FUNCTION convoq_count_statement()",
        f"CREATE TRIGGER {table}_count_update AFTER UPDATE OF status ON {table} FOR EACH ROW "
        "WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION convoq_count_update()",
    ]


def _sqlite_triggers(table: str) -> list[str]:
    row = "INSERT INTO status_counts (table_name, status, n) VALUES"
    return [
        f"CREATE TRIGGER {table}_count_insert AFTER INSERT ON {table} BEGIN {row} ('{table}', NEW.status, 1); END",
        f"CREATE TRIGGER {table}_count_delete AFTER DELETE ON {table} BEGIN {row} ('{table}', OLD.status, -1); END",
        f"CREATE TRIGGER {table}_count_update AFTER UPDATE OF status ON {table} WHEN OLD.status IS NOT NEW.status "
        f"BEGIN {row} ('{table}', OLD.status, -1), ('{table}', NEW.status, 1); END",
    ]


def install(connection: Connection) -> None:
    """Create the triggers and count the rows already there, in the caller's transaction (on PostgreSQL the
    trigger DDL locks the tables against writes until it commits, so no change slips between the two)."""
    postgres = connection.dialect.name == "postgresql"
    for statement in POSTGRES_FUNCTIONS if postgres else []:
        connection.execute(text(statement))
    for table in COUNTED:
        for statement in _postgres_triggers(table) if postgres else _sqlite_triggers(table):
            connection.execute(text(statement))
        connection.execute(text(f"INSERT INTO status_counts (table_name, status, n) "
                                f"SELECT '{table}', status, count(*) FROM {table} GROUP BY status"))


def uninstall(connection: Connection) -> None:
    postgres = connection.dialect.name == "postgresql"
    for table in COUNTED:
        for event in ("insert", "delete", "update"):
            connection.execute(text(f"DROP TRIGGER IF EXISTS {table}_count_{event}" + (f" ON {table}" if postgres else "")))
    if postgres:
        connection.execute(text("DROP FUNCTION IF EXISTS convoq_count_statement(), convoq_count_update()"))


def fold(session: Session) -> None:
    """Replace the deltas by one row per (table, status), in the caller's transaction.

    Deltas appended meanwhile by other transactions are not in this statement's snapshot and stay as they are;
    two folds at once each delete only rows the other did not, so the sums never change."""
    sums: Counter[tuple[str, str]] = Counter()
    for table_name, status, n in session.execute(delete(status_counts).returning(
            status_counts.c.table_name, status_counts.c.status, status_counts.c.n)):
        sums[table_name, status] += n
    rows = [dict(table_name=t, status=s, n=n) for (t, s), n in sums.items() if n]
    if rows:
        session.execute(insert(status_counts), rows)


def counts(session: Session) -> dict[str, dict[str, int]]:
    """table -> status -> rows: the deltas summed, as one statement (a fold commits whole, so a statement sees
    every delta or its folded row, never both)."""
    out: dict[str, dict[str, int]] = {table: {} for table in COUNTED}
    for table_name, status, n in session.execute(
            select(status_counts.c.table_name, status_counts.c.status, func.sum(status_counts.c.n))
            .group_by(status_counts.c.table_name, status_counts.c.status)):
        out.setdefault(table_name, {})[status] = int(n)
    return out
