"""engine step: a timing's `batch_id` (the worker and engine step that first ran the job) renamed `engine_step`,
so that `batch_id` means an OpenAI batch everywhere

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 18:00:00
"""

from __future__ import annotations

from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite rebuilds the table where it cannot rename a column in place
    with op.batch_alter_table('timings') as batch:
        batch.alter_column('batch_id', new_column_name='engine_step')


def downgrade() -> None:
    with op.batch_alter_table('timings') as batch:
        batch.alter_column('engine_step', new_column_name='batch_id')
