"""job control: deadlines, cancel requests, owners; batch completion windows

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 02:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('owner', sa.String(length=64), nullable=True))
    op.add_column('jobs', sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column('cancel_requested_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_jobs_owner_status', 'jobs', ['owner', 'status'])
    op.create_index('ix_jobs_status_deadline', 'jobs', ['status', 'deadline_at'])
    op.add_column('batches', sa.Column('completion_window', sa.String(length=16), nullable=False,
                                       server_default='24h'))
    op.add_column('batches', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('batches', sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # `expired` jobs and batches have no place in the older schema: they count as failed there
    op.execute("UPDATE jobs SET status = 'failed' WHERE status = 'expired'")
    op.execute("UPDATE batches SET status = 'failed', failed_at = expired_at WHERE status = 'expired'")
    op.drop_index('ix_jobs_status_deadline', table_name='jobs')
    op.drop_index('ix_jobs_owner_status', table_name='jobs')
    # batch mode: SQLite rebuilds the table where it cannot drop a column in place
    with op.batch_alter_table('batches') as batch:
        for column in ('expired_at', 'expires_at', 'completion_window'):
            batch.drop_column(column)
    with op.batch_alter_table('jobs') as batch:
        for column in ('cancel_requested_at', 'deadline_at', 'owner'):
            batch.drop_column(column)
