"""Jobs and batches by status, kept by triggers: right after every transition the service makes, on both databases."""

from __future__ import annotations

import uuid
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import insert, update

from api.service.jobs import cancel
from engine.interface import Completion, Timings
from jobs.error_codes import ErrorCode
from jobs.schemas import JobIn
from jobs.settings import ApiKey
from jobs.tables import Batch, Job, job_row, status_counts, utcnow
from store.connections import make_db_engine, make_sessions
from store.counts import counts, fold
from worker import results
from worker.claims import claim_many, end_unrun
from worker.outcome import Outcome
from worker.run_ends import fail, requeue

ADMIN = ApiKey(digest="0" * 64, scopes=frozenset({"admin"}), tenant="ops")


def actual(engine, table: str) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text(f"SELECT status, count(*) FROM {table} GROUP BY status")).all())


def kept(sessions) -> dict[str, dict[str, int]]:
    """The triggers' counts, zeros dropped (a status that emptied reads 0, a table count has no row for it)."""
    with sessions() as session:
        return {table: {s: n for s, n in by.items() if n} for table, by in counts(session).items()}


def assert_counts_right(engine, sessions) -> None:
    assert kept(sessions) == {"jobs": actual(engine, "jobs"), "batches": actual(engine, "batches")}


def done(job_id: uuid.UUID, finish_reason: str = "stop") -> Outcome:
    return Outcome(Completion(str(job_id), [1, 2], "ok", 5, finish_reason, None, Timings()), 1.0)


def test_counts_follow_every_transition(any_database):
    url = any_database
    engine = make_db_engine(url)
    sessions = make_sessions(engine)
    now = utcnow()
    job = JobIn(messages=[{"role": "user", "content": "hi"}])
    with sessions.begin() as session:
        batch = Batch(status="in_progress", priority=1, total=2)
        session.add(batch)
    # every row names the same columns: one statement for all of them
    rows = [job_row(job, now, batch_id=None) for _ in range(6)] + [job_row(job, now, batch_id=batch.id) for _ in range(2)]
    rows[5]["deadline_at"] = now - timedelta(seconds=1)
    ids = [r["id"] for r in rows]
    with sessions.begin() as session:  # submitted in one statement, as a batch upload does
        session.execute(insert(Job.__table__), rows)
    assert kept(sessions) == {"jobs": {"queued": 8}, "batches": {"in_progress": 1}}

    claimed = claim_many(sessions, [str(i) for i in ids[:5] + ids[6:]], "w1", 3)
    assert_counts_right(engine, sessions)
    assert kept(sessions)["jobs"] == {"running": 7, "queued": 1}

    results.store_many(sessions, [(claimed[0], done(ids[0])), (claimed[1], done(ids[1], "cancelled")),
                                  (claimed[5], done(ids[6])), (claimed[6], done(ids[7]))], "w1")
    fail(sessions, claimed[2], ErrorCode.engine_error, "RuntimeError: boom")
    assert requeue(sessions, claimed[3], "RuntimeError: try again")
    assert_counts_right(engine, sessions)
    assert kept(sessions)["batches"] == {"completed": 1}  # its two items finished: the store settled it

    with sessions.begin() as session:  # the reconciler's expiry sweep
        assert len(end_unrun(session, Job.deadline_at <= utcnow())) == 1
    assert cancel(sessions, None, ids[3], ADMIN).status == "cancelled"  # a producer's cancel of a queued job
    with sessions.begin() as session:  # a write that leaves the status alone counts nothing
        session.execute(update(Job).where(Job.id == ids[4]).values(published_at=utcnow()))
    assert_counts_right(engine, sessions)
    assert kept(sessions)["jobs"] == {"succeeded": 3, "cancelled": 2, "failed": 1, "expired": 1, "running": 1}

    with engine.begin() as conn:  # raw SQL, a cascade from a deleted batch: the triggers still see it
        conn.execute(sa.text("UPDATE jobs SET status = 'queued' WHERE status = 'running'"))
        conn.execute(sa.delete(Batch.__table__))
    assert_counts_right(engine, sessions)
    assert kept(sessions) == {"jobs": {"succeeded": 1, "cancelled": 2, "failed": 1, "expired": 1, "queued": 1},
                              "batches": {}}


def test_a_fold_leaves_one_row_per_status(any_database):
    url = any_database
    engine = make_db_engine(url)
    sessions = make_sessions(engine)
    job = JobIn(messages=[{"role": "user", "content": "hi"}])
    for _ in range(3):  # three statements: three deltas for `queued` before the fold
        with sessions.begin() as session:
            session.execute(insert(Job.__table__), [job_row(job, utcnow()) for _ in range(4)])
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET status = 'running'"))
    assert kept(sessions) == {"jobs": {"running": 12}, "batches": {}}  # summed as they are: a read writes nothing
    with sessions.begin() as session:  # what the reconciler's sweep does
        fold(session)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(status_counts.c.table_name, status_counts.c.status, status_counts.c.n)).all()
    # `queued` summed to zero and is gone; `running` is one row
    assert sorted(rows) == [("jobs", "running", 12)]
