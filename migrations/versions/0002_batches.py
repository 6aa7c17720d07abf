"""batches

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 23:31:06.752655
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('batches',
    sa.Column('id', sa.Uuid(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('priority', sa.SmallInteger(), nullable=False),
    sa.Column('input_name', sa.String(length=255), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('line_errors', sa.JSON(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('batch_id', sa.Uuid(), nullable=True))
        batch_op.add_column(sa.Column('custom_id', sa.String(length=255), nullable=True))
        batch_op.create_index('ix_jobs_batch_status', ['batch_id', 'status'], unique=False)
        batch_op.create_unique_constraint('uq_jobs_batch_custom_id', ['batch_id', 'custom_id'])
        batch_op.create_foreign_key('fk_jobs_batch_id', 'batches', ['batch_id'], ['id'], ondelete='CASCADE')

    with op.batch_alter_table('results', schema=None) as batch_op:
        batch_op.add_column(sa.Column('chunks', sa.Integer(), nullable=False, server_default='1'))
        batch_op.add_column(sa.Column('levels', sa.Integer(), nullable=False, server_default='1'))


def downgrade() -> None:
    with op.batch_alter_table('results', schema=None) as batch_op:
        batch_op.drop_column('levels')
        batch_op.drop_column('chunks')

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_constraint('fk_jobs_batch_id', type_='foreignkey')
        batch_op.drop_constraint('uq_jobs_batch_custom_id', type_='unique')
        batch_op.drop_index('ix_jobs_batch_status')
        batch_op.drop_column('custom_id')
        batch_op.drop_column('batch_id')
    op.drop_table('batches')
