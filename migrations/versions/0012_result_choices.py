"""result choices: a result's token log-probabilities, its tool calls, and the further choices of a job that asked
for `n` > 1

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('results', sa.Column('logprobs', sa.JSON(), nullable=True))
    op.add_column('results', sa.Column('tool_calls', sa.JSON(), nullable=True))
    op.add_column('results', sa.Column('choices', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('results') as batch:
        batch.drop_column('choices')
        batch.drop_column('tool_calls')
        batch.drop_column('logprobs')
