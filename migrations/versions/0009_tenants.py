"""tenants: jobs, batches and files belong to a tenant; idempotency keys unique per tenant with the request's
hash; a batch's bad lines in a table of their own (counted on the batch)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 05:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from migrations import status_count_triggers as counts

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

# 0001 left the idempotency key's unique constraint unnamed: PostgreSQL named it, SQLite did not, and batch
# mode finds it on SQLite only through a naming convention
OLD_UNIQUE = {"postgresql": "jobs_idempotency_key_key", "sqlite": "uq_jobs_idempotency_key"}
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _recount_around(change) -> None:
    """Run `change` with the status-count triggers off: on SQLite, batch mode rebuilds `jobs` and `batches`, and
    a rebuilt table has lost its triggers. Put back afterwards, they count the rows as they then are."""
    counts.uninstall(op.get_bind())
    change()
    op.execute("DELETE FROM status_counts")
    counts.install(op.get_bind())


def upgrade() -> None:
    _recount_around(_upgrade)


def downgrade() -> None:
    _recount_around(_downgrade)


def _upgrade() -> None:
    dialect = op.get_bind().dialect.name
    with op.batch_alter_table('jobs', naming_convention=NAMING) as batch:
        batch.add_column(sa.Column('tenant', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('request_hash', sa.String(length=64), nullable=True))
        batch.drop_constraint(OLD_UNIQUE[dialect], type_='unique')
    # what existed belongs to the key that made it: a key without a tenant is a tenant of its own (its hash)
    op.execute("UPDATE jobs SET tenant = owner")
    with op.batch_alter_table('jobs') as batch:
        batch.create_unique_constraint('uq_jobs_tenant_idempotency_key', ['tenant', 'idempotency_key'])
        batch.create_index('ix_jobs_tenant_created', ['tenant', 'created_at'])

    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('tenant', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('invalid_lines', sa.Integer(), nullable=False, server_default='0'))
        batch.create_index('ix_batches_tenant_created', ['tenant', 'created_at', 'id'])
    op.execute("UPDATE batches SET tenant = (SELECT max(jobs.owner) FROM jobs WHERE jobs.batch_id = batches.id)")

    op.create_table('batch_line_errors',
    sa.Column('batch_id', sa.Uuid(), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.String(length=255), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name='fk_batch_line_errors_batch_id', ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('batch_id', 'line')
    )
    _move_line_errors()
    with op.batch_alter_table('batches') as batch:
        batch.drop_column('line_errors')

    with op.batch_alter_table('files') as batch:
        batch.add_column(sa.Column('tenant', sa.String(length=64), nullable=True))
        batch.drop_index('ix_files_owner_created')
        batch.create_index('ix_files_tenant_created', ['tenant', 'created_at', 'id'])
    op.execute("UPDATE files SET tenant = owner")


def _move_line_errors() -> None:
    """Each batch's JSON list of bad lines into rows (and their count onto the batch)."""
    bind = op.get_bind()
    batches = sa.table('batches', sa.column('id', sa.Uuid()), sa.column('line_errors', sa.JSON()),
                       sa.column('invalid_lines', sa.Integer()))
    rows = sa.table('batch_line_errors', sa.column('batch_id', sa.Uuid()), sa.column('line', sa.Integer()),
                    sa.column('custom_id', sa.String()), sa.column('message', sa.Text()))
    for batch_id, errors in bind.execute(sa.select(batches.c.id, batches.c.line_errors)).all():
        if errors:
            bind.execute(sa.insert(rows), [{"batch_id": batch_id, "line": e["line"], "custom_id": e.get("custom_id"),
                                            "message": e["message"]} for e in errors])
            bind.execute(sa.update(batches).where(batches.c.id == batch_id).values(invalid_lines=len(errors)))


def _downgrade() -> None:
    dialect = op.get_bind().dialect.name
    with op.batch_alter_table('files') as batch:
        batch.drop_index('ix_files_tenant_created')
        batch.create_index('ix_files_owner_created', ['owner', 'created_at', 'id'])
        batch.drop_column('tenant')

    with op.batch_alter_table('batches') as batch:
        batch.add_column(sa.Column('line_errors', sa.JSON(), nullable=True))
    bind = op.get_bind()
    batches = sa.table('batches', sa.column('id', sa.Uuid()), sa.column('line_errors', sa.JSON()))
    rows = sa.table('batch_line_errors', sa.column('batch_id', sa.Uuid()), sa.column('line', sa.Integer()),
                    sa.column('custom_id', sa.String()), sa.column('message', sa.Text()))
    found: dict = {}
    for batch_id, line, custom_id, message in bind.execute(sa.select(rows).order_by(rows.c.batch_id, rows.c.line)):
        found.setdefault(batch_id, []).append({"line": line, "custom_id": custom_id, "message": message})
    for batch_id, errors in found.items():
        bind.execute(sa.update(batches).where(batches.c.id == batch_id).values(line_errors=errors))
    op.execute("UPDATE batches SET line_errors = '[]' WHERE line_errors IS NULL")
    with op.batch_alter_table('batches') as batch:
        batch.alter_column('line_errors', existing_type=sa.JSON(), nullable=False)
        batch.drop_index('ix_batches_tenant_created')
        batch.drop_column('invalid_lines')
        batch.drop_column('tenant')
    op.drop_table('batch_line_errors')

    # one key for everyone again: a key that several tenants used is kept by none of them
    op.execute("UPDATE jobs SET idempotency_key = NULL WHERE idempotency_key IN (SELECT idempotency_key FROM jobs "
               "WHERE idempotency_key IS NOT NULL GROUP BY idempotency_key HAVING count(*) > 1)")
    with op.batch_alter_table('jobs', naming_convention=NAMING) as batch:
        batch.drop_index('ix_jobs_tenant_created')
        batch.drop_constraint('uq_jobs_tenant_idempotency_key', type_='unique')
        batch.create_unique_constraint(OLD_UNIQUE[dialect], ['idempotency_key'])
        batch.drop_column('request_hash')
        batch.drop_column('tenant')
