"""`convoq prune`: delete finished work older than a cut-off (see `store.retention`), with a progress bar."""

from __future__ import annotations

import sys
from datetime import timedelta

from tqdm import tqdm

from store.connections import make_db_engine, make_sessions
from store.retention import PruneReport, prune


def run_prune(database_url: str, older_than: timedelta, dry_run: bool, chunk: int) -> PruneReport:
    """Count first, so a long prune shows how far it has come; then delete (unless `dry_run`)."""
    engine = make_db_engine(database_url)
    sessions = make_sessions(engine)
    try:
        planned = prune(sessions, older_than, chunk, dry_run=True)
        if dry_run:
            return planned
        # a bar only when there is more than one chunk to wait for; on stderr, so stdout stays the summary
        with tqdm(total=planned.jobs, unit="job", file=sys.stderr, disable=planned.jobs <= chunk) as bar:
            return prune(sessions, older_than, chunk, progress=bar.update)
    finally:
        engine.dispose()
