"""worker usage: each worker's CPU time (its engine process's included) and the jobs it finished, stamped at its
heartbeats, for the report's CPU per job

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('cpu_s', sa.Float(), nullable=True))
    op.add_column('workers', sa.Column('jobs_finished', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers') as batch:
        batch.drop_column('jobs_finished')
        batch.drop_column('cpu_s')
