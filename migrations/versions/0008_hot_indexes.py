"""hot indexes: report and retention windows, the reconciler's sweeps, heartbeats; status counts kept by triggers

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import status_count_triggers as counts

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_jobs_created', 'jobs', ['created_at'])
    op.create_index('ix_jobs_queued_published', 'jobs', ['published_at', 'created_at'],
                    postgresql_where=sa.text("status = 'queued'"))
    op.create_index('ix_jobs_running_worker', 'jobs', ['worker'], postgresql_where=sa.text("status = 'running'"))
    op.create_index('ix_jobs_finished', 'jobs', ['finished_at'], postgresql_where=sa.text("finished_at IS NOT NULL"))
    op.create_index('ix_workers_heartbeat', 'workers', ['heartbeat_at'])
    op.create_table('status_counts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('table_name', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('n', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    counts.install(op.get_bind())


def downgrade() -> None:
    counts.uninstall(op.get_bind())
    op.drop_table('status_counts')
    op.drop_index('ix_workers_heartbeat', table_name='workers')
    for name in ('ix_jobs_finished', 'ix_jobs_running_worker', 'ix_jobs_queued_published', 'ix_jobs_created'):
        op.drop_index(name, table_name='jobs')
