"""Jobs and batches by status without counting the tables: triggers append deltas, a reader folds them.

Why triggers appending deltas: a scrape must not scan a table that holds every job ever kept, and a count
maintained in application code is one any new write path can forget (the API, the worker, the reconciler,
retention and raw SQL all change statuses). Triggers see every change, in the transaction that makes it.
They *append* +1/-1 rows instead of updating one row per status: a shared counter row would be
locked by every submission, claim and store until its commit, serializing them all and deadlocking
transactions that move jobs in opposite directions (queued -> running against running -> queued).
Appends never wait on each other. `fold` turns the deltas back into one row per status; the reconciler's sweep
folds every `sweep_every_s` and retention after every prune, so the table stays a handful of rows plus the
changes since. `/metrics` only reads (a scrape needs no key, so it must not write).

Inserts and deletes are counted per statement on PostgreSQL (a batch upload or a prune chunk adds one row per
status, not per job); updates per row, and only when the status changed (a `published_at` stamp adds
nothing). SQLite has no statement triggers: there every row adds its own delta.

The triggers are the migrations' (`migrations.status_count_triggers`, frozen as they made them): a SQLite
migration that rebuilds `jobs` or `batches` (Alembic's batch mode) drops them and must install them again.
`tests/test_counts.py` checks the migrated schema counts on both databases.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from jobs.tables import status_counts

COUNTED = ("jobs", "batches")


def fold(session: Session) -> None:
    """Replace the deltas by one row per (table, status), in the caller's transaction.

    Deltas appended meanwhile by other transactions are not in this statement's snapshot and stay as they are;
    two folds at once each delete only rows the other did not, so the sums never change."""
    sums: Counter[tuple[str, str]] = Counter()
    for table_name, status, n in session.execute(delete(status_counts).returning(
            status_counts.c.table_name, status_counts.c.status, status_counts.c.n)):
        sums[table_name, status] += n
    rows = [dict(table_name=t, status=s, n=n) for (t, s), n in sums.items() if n]
    if rows:
        session.execute(insert(status_counts), rows)


def counts(session: Session) -> dict[str, dict[str, int]]:
    """table -> status -> rows: the deltas summed, as one statement (a fold commits whole, so a statement sees
    every delta or its folded row, never both)."""
    out: dict[str, dict[str, int]] = {table: {} for table in COUNTED}
    for table_name, status, n in session.execute(
            select(status_counts.c.table_name, status_counts.c.status, func.sum(status_counts.c.n))
            .group_by(status_counts.c.table_name, status_counts.c.status)):
        out.setdefault(table_name, {})[status] = int(n)
    return out
