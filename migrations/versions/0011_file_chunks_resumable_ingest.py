"""file chunks, resumable ingests: a file's bytes in rows of 1 MiB; a batch keeps its owner, the stored file its
lines are read from and its ingest's lease; what a stored batch shows within the bounds its answer has (metadata
within OpenAI's, an expiry on every batch)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

from migrations import status_count_triggers as counts

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

CHUNK = 2**20  # the chunk size of this migration (readers take whatever size the chunks have)
LOST = ("its upload was lost in an API restart before its lines were read (before migration 0011 an upload "
        "waited in a temporary file); send the batch again")

files = sa.table('files', sa.column('id', sa.String()), sa.column('owner', sa.String()),
                 sa.column('content', sa.LargeBinary()))
chunks = sa.table('file_chunks', sa.column('file_id', sa.String()), sa.column('seq', sa.Integer()),
                  sa.column('data', sa.LargeBinary()))
batches = sa.table('batches', sa.column('id', sa.Uuid()), sa.column('status', sa.String()),
                   sa.column('metadata', sa.JSON()), sa.column('input_file_id', sa.String()),
                   sa.column('source_file_id', sa.String()), sa.column('owner', sa.String()),
                   sa.column('invalid_lines', sa.Integer()), sa.column('failed_at', sa.DateTime(timezone=True)),
                   sa.column('created_at', sa.DateTime(timezone=True)), sa.column('completion_window', sa.String()),
                   sa.column('expires_at', sa.DateTime(timezone=True)))

# What a batch may show and how long its window is, as the API had them at this revision: frozen here, so that
# this migration does what it did whatever the API's bounds become.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 24 * 3600
DEFAULT_COMPLETION_WINDOW = "24h"


def safe_metadata(stored: object) -> dict[str, str]:
    """Of what a row holds, the string keys and values within OpenAI's bounds."""
    if not isinstance(stored, dict):
        return {}
    kept = {k: v for k, v in stored.items() if isinstance(k, str) and isinstance(v, str) and "\x00" not in k + v
            and len(k) <= METADATA_KEY_CHARS and len(v) <= METADATA_VALUE_CHARS}
    return dict(list(kept.items())[:METADATA_KEYS])


def window_seconds(window: str) -> int:
    """A completion window (`"24h"`, `"90s"`, `"30m"`, `"2d"`) in seconds; ValueError for one the API refuses."""
    match = re.fullmatch(r"([1-9]\d{0,6})([smhd])", window)
    if match is None or int(match[1]) * WINDOW_UNITS[match[2]] > MAX_WINDOW_S:
        raise ValueError(f"completion_window {window!r}")
    return int(match[1]) * WINDOW_UNITS[match[2]]


def as_utc(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; every time written is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _recount_around(change) -> None:
    """As in 0009: SQLite's batch mode rebuilds `batches`, and a rebuilt table has lost its triggers."""
    counts.uninstall(op.get_bind())
    change()
    op.execute("DELETE FROM status_counts")
    counts.install(op.get_bind())


def upgrade() -> None:
    op.create_table('file_chunks',
    sa.Column('file_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['file_id'], ['files.id'], name='fk_file_chunks_file_id', ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('file_id', 'seq')
    )
    _chunk_contents()
    op.drop_column('files', 'content')  # in place on SQLite too (3.35+): a copy of `files` would be its size again
    _recount_around(_add_ingest_columns)
    _adopt_validating()
    _bound_metadata()
    _fill_expiry()


def _chunk_contents() -> None:
    """Each file's content into chunks, a chunk per statement: never a whole file in memory."""
    bind = op.get_bind()
    for file_id, size in bind.execute(sa.select(files.c.id, sa.func.length(files.c.content))).all():
        for seq in range(-(-size // CHUNK)):
            piece = sa.select(sa.literal(file_id), sa.literal(seq), sa.func.substr(files.c.content, seq * CHUNK + 1, CHUNK))
            bind.execute(sa.insert(chunks).from_select(['file_id', 'seq', 'data'], piece.where(files.c.id == file_id)))


def _add_ingest_columns() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('owner', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('source_file_id', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('ingest_lease_id', sa.Uuid(), nullable=True))
        batch.add_column(sa.Column('ingest_lease_expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('ingest_failures', sa.Integer(), server_default='0', nullable=False))
        batch.create_foreign_key('fk_batches_source_file_id', 'files', ['source_file_id'], ['id'])
        batch.create_index('ix_batches_source_file', ['source_file_id'],
                           postgresql_where=sa.text('source_file_id IS NOT NULL'))


def _adopt_validating() -> None:
    """Batches still validating were being read by an API process of the version before: one made from a stored
    file is resumed from it by the new ones (its lease is free); a multipart upload's lines are gone."""
    bind = op.get_bind()
    validating = batches.c.status == 'validating'
    owner = sa.select(files.c.owner).where(files.c.id == batches.c.input_file_id).scalar_subquery()
    bind.execute(sa.update(batches).where(validating, owner.is_not(None))
                 .values(source_file_id=batches.c.input_file_id, owner=owner))
    lost = [row.id for row in bind.execute(sa.select(batches.c.id).where(validating, batches.c.source_file_id.is_(None)))]
    if lost:
        errors = sa.table('batch_line_errors', sa.column('batch_id', sa.Uuid()), sa.column('line', sa.Integer()),
                          sa.column('message', sa.Text()))
        bind.execute(sa.insert(errors), [{"batch_id": i, "line": 0, "message": LOST} for i in lost])
        bind.execute(sa.update(batches).where(batches.c.id.in_(lost))
                     .values(status='failed', failed_at=sa.func.current_timestamp(), invalid_lines=1))


def _bound_metadata() -> None:
    """Metadata stored before it was bounded (any JSON, nested as deep as a parser allowed) within OpenAI's
    bounds, so that no read of it can fail. Read as text: parsing it may be what fails."""
    bind = op.get_bind()
    for batch_id, text in bind.execute(sa.select(batches.c.id, sa.cast(batches.c.metadata, sa.Text))).all():
        try:
            stored = json.loads(text) if text else {}
        except (ValueError, RecursionError):  # nested past what Python parses: nothing of it can be shown
            stored = None
        if safe_metadata(stored) != stored:
            bind.execute(sa.update(batches).where(batches.c.id == batch_id).values(metadata=safe_metadata(stored)))


def _fill_expiry() -> None:
    """Batches from before 0004 have no expiry, which a Batch object must show: their creation plus their window,
    as every batch since."""
    bind = op.get_bind()
    for batch_id, created, window in bind.execute(sa.select(batches.c.id, batches.c.created_at,
                                                            batches.c.completion_window)
                                                  .where(batches.c.expires_at.is_(None))).all():
        try:
            seconds = window_seconds(window)
        except ValueError:
            seconds = window_seconds(DEFAULT_COMPLETION_WINDOW)
        bind.execute(sa.update(batches).where(batches.c.id == batch_id)
                     .values(expires_at=as_utc(created) + timedelta(seconds=seconds)))


def downgrade() -> None:
    _recount_around(_drop_ingest_columns)
    with op.batch_alter_table('files') as batch:
        batch.add_column(sa.Column('content', sa.LargeBinary(), nullable=True))
    bind = op.get_bind()
    for (file_id,) in bind.execute(sa.select(files.c.id)).all():
        data = b"".join(bind.execute(sa.select(chunks.c.data).where(chunks.c.file_id == file_id)
                                     .order_by(chunks.c.seq)).scalars())
        bind.execute(sa.update(files).where(files.c.id == file_id).values(content=data))
    op.drop_table('file_chunks')
    with op.batch_alter_table('files') as batch:
        batch.alter_column('content', existing_type=sa.LargeBinary(), nullable=False)


def _drop_ingest_columns() -> None:
    with op.batch_alter_table('batches') as batch:
        batch.drop_index('ix_batches_source_file')
        batch.drop_constraint('fk_batches_source_file_id', type_='foreignkey')
        batch.drop_column('ingest_failures')
        batch.drop_column('ingest_lease_expires_at')
        batch.drop_column('ingest_lease_id')
        batch.drop_column('source_file_id')
        batch.drop_column('owner')
