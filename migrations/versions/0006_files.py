"""files: uploads kept for batches (OpenAI's Files API); a batch's input file; batches listed newest first

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('owner', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('content', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_files_owner_created', 'files', ['owner', 'created_at', 'id'])
    op.add_column('batches', sa.Column('input_file_id', sa.String(length=64), nullable=True))
    op.create_index('ix_batches_created', 'batches', ['created_at', 'id'])


def downgrade() -> None:
    op.drop_index('ix_batches_created', table_name='batches')
    # batch mode: SQLite rebuilds the table where it cannot drop a column in place
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('input_file_id')
    op.drop_index('ix_files_owner_created', table_name='files')
    op.drop_table('files')
