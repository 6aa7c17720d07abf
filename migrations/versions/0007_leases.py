"""leases with fencing tokens, crash counts, missing messages, runs, the reconciler's sweep stamp

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('lease_id', sa.Uuid(), nullable=True))
    op.add_column('jobs', sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column('crashes', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('jobs', sa.Column('alone_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column('message_missing_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_jobs_lease_expiry', 'jobs', ['lease_expires_at'],
                    postgresql_where=sa.text("status = 'running'"))
    op.create_table(
        'runs',
        sa.Column('job_id', sa.Uuid(), sa.ForeignKey('jobs.id', ondelete='CASCADE'), primary_key=True),
        sa.Column('lease_id', sa.Uuid(), primary_key=True),
        sa.Column('worker', sa.String(length=255), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('outcome', sa.String(length=16), nullable=True),
        sa.Column('alone', sa.Boolean(), nullable=False, server_default=sa.text('false')),
        sa.Column('stale_writes', sa.Integer(), nullable=False, server_default='0'),
    )
    op.create_table(
        'sweeps',
        sa.Column('name', sa.String(length=32), primary_key=True),
        sa.Column('swept_at', sa.DateTime(timezone=True), nullable=False),
    )
    # running jobs of the older schema hold no lease: give them one that expires at once, so the reconciler
    # hands back those whose worker is gone (a live worker renews only leases it took itself)
    op.execute("UPDATE jobs SET lease_expires_at = started_at WHERE status = 'running'")


def downgrade() -> None:
    op.drop_table('sweeps')
    op.drop_table('runs')
    op.drop_index('ix_jobs_lease_expiry', table_name='jobs')
    with op.batch_alter_table('jobs') as batch:
        for column in ('message_missing_at', 'alone_at', 'crashes', 'lease_expires_at', 'lease_id'):
            batch.drop_column(column)
