"""What a worker's death says about the jobs it held. A sweep hands back every job whose lease expired, and
`attribute` decides what each crash says about each job."""

from __future__ import annotations

import logging
import uuid
from collections import Counter

from sqlalchemy import Row, select
from sqlalchemy.orm import Session, sessionmaker

from jobs.tables import Job, Run
from store.clock import db_now
from worker.chunks import CHUNK, Hold, keep_hold
from worker.database import retrying, settle
from worker.fence import RUNNING, end_runs
from worker.run_ends import lost_run_updates

log = logging.getLogger(__name__)


def attribute(expired: list[Row], blamed_workers: set[str], max_crashes: int) -> dict[uuid.UUID, str]:
    """What each job whose lease expired (its worker died, froze or was cut off) becomes:
    - `condemned`: it ran alone in its worker, so the worker's end was its doing; it fails;
    - `spared`: its worker's end is blamed on a job that ran alone there; it goes back uncharged;
    - `crashed`: nothing tells which job did it; it goes back a suspect (`crashes` + 1), or
    - `exhausted`: it has now been in `max_crashes` crashes; it fails.
    `blamed_workers`: workers whose end an earlier sweep already blamed on a job that ran alone."""
    blamed = blamed_workers | {row.worker for row in expired if row.alone_at is not None}
    verdicts = {}
    for row in expired:
        if row.alone_at is not None:
            verdicts[row.id] = "condemned"
        elif row.worker in blamed:
            verdicts[row.id] = "spared"
        else:
            verdicts[row.id] = "exhausted" if row.crashes + 1 >= max_crashes else "crashed"
    return verdicts


def crash_error(verdict: str, crashes: int) -> str:
    """The error of a job failed for crashes; `crashes` counts this one."""
    if verdict == "condemned":
        return (f"its worker died while it ran alone ({crashes} worker deaths with it running): it is taken to be "
                "the cause")
    return f"workers died {crashes} times while it ran (CONVOQ_MAX_CRASHES)"


def hand_back_expired(sessions: sessionmaker[Session], max_crashes: int, hold: Hold = None) -> Counter:
    """Hand back every running job whose lease expired, in chunks (`hold` is called before each, see
    `sweep_lock`); returns how many got each verdict."""
    jobs, runs = Job.__table__, Run.__table__
    counts: Counter = Counter()
    back, failed = lost_run_updates()
    while True:
        keep_hold(hold)
        with sessions.begin() as session:
            expired = session.execute(
                select(jobs.c.id, jobs.c.worker, jobs.c.lease_id, jobs.c.alone_at, jobs.c.crashes, jobs.c.batch_id)
                .where(jobs.c.status == RUNNING, jobs.c.lease_expires_at < db_now())
                .order_by(jobs.c.worker).limit(CHUNK).with_for_update(skip_locked=True)
            ).all()
            if not expired:
                break
            blamed = set(session.scalars(select(runs.c.worker).where(
                runs.c.outcome == "condemned", runs.c.worker.in_({row.worker for row in expired}))))
            verdicts = attribute(expired, blamed, max_crashes)
            rows = {row.id: row for row in expired}
            back_rows = [dict(j=i, l=rows[i].lease_id, charge=int(v == "crashed"))
                         for i, v in verdicts.items() if v in ("crashed", "spared")]
            fail_rows = [dict(j=i, l=rows[i].lease_id, e=crash_error(v, rows[i].crashes + 1))
                         for i, v in verdicts.items() if v in ("condemned", "exhausted")]
            if back_rows:
                session.connection().execute(back, back_rows)
            if fail_rows:
                session.connection().execute(failed, fail_rows)
            outcome = {"condemned": "condemned", "spared": "returned", "crashed": "crashed", "exhausted": "crashed"}
            end_runs(session, [(i, rows[i].lease_id, outcome[v]) for i, v in verdicts.items()])
        counts.update(verdicts.values())
        for batch_id in {rows[f["j"]].batch_id for f in fail_rows} - {None}:
            retrying(lambda b=batch_id: settle(sessions, b), f"settle batch {batch_id}")
        if len(expired) < CHUNK:
            break
    if counts:
        log.warning("reconciler: leases expired: %s", dict(counts))
    return counts
