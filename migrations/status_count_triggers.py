"""The status-count triggers as migration 0008 made them (0009 and 0011 put the same back around a table SQLite
rebuilds). Frozen: a migration that changes them brings its own, so that every revision keeps making what it
made. `store.counts` reads and folds what they write."""

from __future__ import annotations

from sqlalchemy import Connection, text

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
    """Create the triggers and count the rows already there, in the migration's transaction."""
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
