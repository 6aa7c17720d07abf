"""Alembic environment: the URL comes from the caller's Config or from CONVOQ_DATABASE_URL."""

from __future__ import annotations

from alembic import context

from jobs.settings import get_settings
from jobs.tables import Base
from store.connections import make_db_engine

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().database_url.get_secret_value()


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = make_db_engine(url)
    with engine.connect() as connection:
        if connection.dialect.name == "sqlite":
            # Batch mode copies a table, drops it and renames the copy: with foreign keys enforced, the drop would
            # first delete every row that references the table (ON DELETE CASCADE). Off for this connection, and
            # before its transaction, or SQLite ignores the pragma.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        # SQLite alters tables by copying them: batch mode makes the same migrations work there
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
