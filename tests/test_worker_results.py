"""The worker's writes are idempotent, survive odd model output, and never leave a job `running`."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from engine.interface import Completion, Timings
from jobs.db import make_engine, make_sessions
from jobs.tables import Job
from worker import results
from worker.payload import Outcome


def new_job(sessions) -> str:
    with sessions.begin() as session:
        job = Job(kind="chat", priority=5, payload={"kind": "chat", "priority": 5, "messages": []}, status="queued")
        session.add(job)
    return str(job.id)


def counts(engine, job_id: str) -> tuple[str, int, int]:
    with engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :i"), {"i": uuid.UUID(job_id)}).scalar_one()
        n_results = conn.execute(sa.text("SELECT count(*) FROM results")).scalar_one()
        n_timings = conn.execute(sa.text("SELECT count(*) FROM timings")).scalar_one()
    return status, n_results, n_timings


def outcome(job_id: str, text: str = "fine") -> Outcome:
    return Outcome(Completion(job_id, [1, 2, 3], text, 7, "length", None, Timings(batch_id=3, batch_size=2)), 12.0)


def test_a_message_delivered_twice_stores_one_result(database):
    engine = make_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    first = results.claim(sessions, job_id, "w1")
    second = results.claim(sessions, job_id, "w2")  # redelivered while the first still runs
    results.store(sessions, first, outcome(job_id), "w1")
    results.store(sessions, second, outcome(job_id, "other"), "w2")
    assert counts(engine, job_id) == ("succeeded", 1, 1)
    assert results.claim(sessions, job_id, "w3") is None  # a third delivery finds it finished


def test_nul_in_generated_text_is_stored(database):
    engine = make_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    results.store(sessions, results.claim(sessions, job_id, "w"), outcome(job_id, "a\x00b"), "w")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM results")).scalar_one() == "a\ufffdb"


def test_a_crashed_run_marks_the_job_failed(database):
    engine = make_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    results.fail(sessions, results.claim(sessions, job_id, "w"), "RuntimeError: boom")
    assert counts(engine, job_id) == ("failed", 0, 0)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT error FROM jobs")).scalar_one() == "RuntimeError: boom"
