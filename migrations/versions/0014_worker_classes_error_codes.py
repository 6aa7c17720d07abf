"""worker classes and error codes: each worker's row says which classes of its own queue it consumes, whether
it takes conversations (affinity) and when it began draining, so that the router places a conversation only where
it will be read; a job's error becomes a stable code and message for its tenant, with the exception's text kept
apart for operators

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL on rows written before this revision: such a worker is read as consuming both classes, as it did
    op.add_column('workers', sa.Column('classes', sa.String(length=32), nullable=True))
    op.add_column('workers', sa.Column('affinity', sa.Boolean(), nullable=False, server_default=sa.text('true')))
    op.add_column('workers', sa.Column('draining_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column('error_code', sa.String(length=32), nullable=True))
    op.add_column('jobs', sa.Column('error_detail', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('error_detail')
        batch.drop_column('error_code')
    with op.batch_alter_table('workers') as batch:
        batch.drop_column('draining_at')
        batch.drop_column('affinity')
        batch.drop_column('classes')
