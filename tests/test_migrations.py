"""Alembic migrations go up from empty and back down, on PostgreSQL and on the embedded SQLite default."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from jobs.tables import Base
from migrations.apply import downgrade, upgrade


@pytest.fixture(params=["postgres", "sqlite"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/sub/convoq.db"
    return request.getfixturevalue("empty_database")


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    names = set(sa.inspect(engine).get_table_names())
    engine.dispose()
    return names


def test_upgrade_then_downgrade(url):
    upgrade(url)
    assert set(Base.metadata.tables) <= tables(url)
    downgrade(url)
    assert tables(url) <= {"alembic_version"}
    upgrade(url)  # and up again: downgrade left nothing behind that would collide
    assert set(Base.metadata.tables) <= tables(url)


def test_migrations_match_the_models(url):
    """Autogenerate finds nothing to do: the tables the code uses are the tables the migrations make."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    upgrade(url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
