"""result reasoning: a thinking model's reasoning, kept apart from its answer

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('results', sa.Column('reasoning', sa.Text(), nullable=True))


def downgrade() -> None:
    # batch mode: SQLite rebuilds the table where it cannot drop a column in place
    with op.batch_alter_table('results') as batch:
        batch.drop_column('reasoning')
