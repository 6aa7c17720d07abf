"""Alembic migrations go up from empty and back down, on PostgreSQL and on the embedded SQLite default."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

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


def test_0011_keeps_what_was_stored(url):
    """Files' bytes move into chunks, batches still validating are resumed from their file (or failed, when their
    upload was a temporary file of a process now gone), stored metadata and missing expiries become what a Batch
    object may show, and the tables rebuilt on SQLite keep the rows that refer to them."""
    upgrade(url, "0010")
    engine = sa.create_engine(url)
    content = bytes(range(256)) * 10_000 + b"\n"  # 2.44 MiB
    now = datetime.now(UTC)
    from_file, uploaded, old = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    files = sa.table("files", *(sa.column(c) for c in ("id", "purpose", "filename", "bytes", "owner", "tenant")),
                     sa.column("created_at", sa.DateTime(timezone=True)), sa.column("content", sa.LargeBinary()))
    def batches_table(*more: str) -> sa.TableClause:
        return sa.table("batches", sa.column("id", sa.Uuid()), *(sa.column(c) for c in (
                            "status", "priority", "total", "tenant", "input_file_id", "completion_window", *more)),
                        sa.column("metadata", sa.JSON()), sa.column("created_at", sa.DateTime(timezone=True)),
                        sa.column("expires_at", sa.DateTime(timezone=True)))

    batches = batches_table()
    jobs = sa.table("jobs", sa.column("id", sa.Uuid()), sa.column("batch_id", sa.Uuid()), sa.column("payload", sa.JSON()),
                    *(sa.column(c) for c in ("status", "kind", "priority", "attempts", "custom_id")),
                    sa.column("created_at", sa.DateTime(timezone=True)))
    batch = dict(priority=1, total=0, tenant="t", completion_window="24h", created_at=now, expires_at=now)
    with engine.begin() as conn:
        conn.execute(sa.insert(files), dict(id="file-1", purpose="batch", filename="a.jsonl", bytes=len(content),
                                            owner="o" * 64, tenant="t", created_at=now, content=content))
        conn.execute(sa.insert(batches), [
            {**batch, "id": from_file, "status": "validating", "input_file_id": "file-1", "metadata": {}},
            {**batch, "id": uploaded, "status": "validating", "input_file_id": None, "metadata": {}},
            {**batch, "id": old, "status": "completed", "input_file_id": None, "expires_at": None,
             "metadata": {"deep": json.loads("[" * 200 + "]" * 200), "kept": "yes"}}])
        conn.execute(sa.insert(jobs), dict(id=uuid.uuid4(), batch_id=old, payload={}, status="succeeded", kind="chat",
                                           priority=1, attempts=1, custom_id="c", created_at=now))
    upgrade(url)
    batches = batches_table("source_file_id", "owner")
    chunks = sa.table("file_chunks", sa.column("file_id"), sa.column("seq"), sa.column("data", sa.LargeBinary()))
    with engine.connect() as conn:
        stored = conn.execute(sa.select(chunks.c.data).where(chunks.c.file_id == "file-1").order_by(chunks.c.seq)).scalars().all()
        rows = {r.id: r for r in conn.execute(sa.select(batches))}
        kept_jobs = conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar_one()
        errors = conn.execute(sa.text("SELECT line, message FROM batch_line_errors")).all()
    engine.dispose()
    assert b"".join(stored) == content and [len(c) for c in stored] == [2**20, 2**20, len(content) - 2**21]
    assert (rows[from_file].status, rows[from_file].source_file_id, rows[from_file].owner) == ("validating", "file-1",
                                                                                               "o" * 64)
    assert rows[uploaded].status == "failed" and [line for line, _ in errors] == [0]
    assert rows[old].metadata == {"kept": "yes"} and rows[old].expires_at is not None
    assert kept_jobs == 1
