"""Retention: old finished work goes, in chunks, with its rows; anything unfinished or recent stays."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import insert
from typer.testing import CliRunner

from cli.main import app
from jobs.schemas import JobIn
from jobs.tables import Batch, Job, Result, Timing, Worker, job_row, utcnow
from store.connections import make_db_engine, make_sessions
from store.counts import counts
from store.retention import prune

NOW = utcnow()
OLD = NOW - timedelta(days=40)
RECENT = NOW - timedelta(days=2)


def add_job(session, status: str, finished_at=None, batch_id=None, worker=None, stored: bool = False) -> uuid.UUID:
    job = JobIn(messages=[{"role": "user", "content": "hi"}])
    row = job_row(job, OLD, status=status, finished_at=finished_at, batch_id=batch_id, worker=worker)
    session.execute(insert(Job.__table__), row)
    if stored:
        session.execute(insert(Result.__table__), dict(job_id=row["id"], text="t", prompt_tokens=1, completion_tokens=1,
                                                       finish_reason="stop", created_at=finished_at))
        session.execute(insert(Timing.__table__), dict(
            job_id=row["id"], queue_wait_ms=1, ttft_ms=1, prefill_ms=1, decode_ms=1, engine_ms=1, end_to_end_ms=1,
            tokens_per_s=1, batch_size=1, prompt_tokens_reused=0, host_tokens_reused=0, created_at=finished_at))
    return row["id"]


def add_batch(session, status: str, settled_at=None) -> uuid.UUID:
    batch_id = uuid.uuid4()
    session.execute(insert(Batch.__table__), dict(id=batch_id, status=status, priority=1, total=2, line_errors=[],
                                                  metadata={}, created_at=OLD, completed_at=settled_at))
    return batch_id


def add_worker(session, name: str, heartbeat_at) -> None:
    session.execute(insert(Worker.__table__), dict(name=name, hostname="h", pid=1, started_at=OLD,
                                                   heartbeat_at=heartbeat_at))


@pytest.fixture
def history(database) -> dict[str, set]:
    """A database with old and recent, finished and unfinished work; what a 30-day prune must delete."""
    sessions = make_sessions(make_db_engine(database))
    gone: dict[str, set] = {"jobs": set(), "batches": set(), "workers": {"long-dead"}}
    with sessions.begin() as s:
        gone["jobs"] |= {add_job(s, status, OLD, stored=status == "succeeded")
                         for status in ("succeeded", "succeeded", "failed", "cancelled", "expired")}
        add_job(s, "succeeded", RECENT, stored=True)  # finished lately: kept
        add_job(s, "queued")  # submitted long ago, still waiting: kept
        add_job(s, "running", worker="silent-but-busy")
        settled = add_batch(s, "completed", OLD)
        gone["batches"].add(settled)
        gone["jobs"] |= {add_job(s, "succeeded", OLD, batch_id=settled, stored=True) for _ in range(3)}
        open_batch = add_batch(s, "in_progress")  # its old finished items stay with it
        add_job(s, "succeeded", OLD, batch_id=open_batch, stored=True)
        add_job(s, "queued", batch_id=open_batch)
        add_job(s, "failed", OLD, batch_id=add_batch(s, "completed", RECENT))  # settled lately: kept
        add_worker(s, "long-dead", OLD)
        add_worker(s, "silent-but-busy", OLD)  # a running job names it
        add_worker(s, "alive", NOW)
    return gone


def rows(database) -> dict[str, set]:
    engine = make_db_engine(database)
    with engine.connect() as conn:
        out = {table: set(conn.execute(sa.text(f"SELECT {key} FROM {table}")).scalars())
               for table, key in (("jobs", "id"), ("batches", "id"), ("workers", "name"), ("results", "job_id"),
                                  ("timings", "job_id"))}
    engine.dispose()
    return out


def test_a_dry_run_counts_and_a_prune_deletes_exactly_that_in_chunks(database, history):
    sessions = make_sessions(make_db_engine(database))
    before = rows(database)
    planned = prune(sessions, timedelta(days=30), chunk=3, dry_run=True)
    assert rows(database) == before  # nothing deleted
    stored_gone = {i for i in history["jobs"] if i in before["results"]}
    expected = dict(jobs=len(history["jobs"]), results=len(stored_gone), timings=len(stored_gone),
                    batches=len(history["batches"]), workers=len(history["workers"]))
    assert {k: getattr(planned, k) for k in expected} == expected

    chunks: list[int] = []
    done = prune(sessions, timedelta(days=30), chunk=3, progress=chunks.append)
    assert {k: getattr(done, k) for k in expected} == expected and not done.dry_run
    assert sum(chunks) == len(history["jobs"]) and max(chunks) <= 3 and len(chunks) >= 3
    after = rows(database)
    for table in ("jobs", "batches", "workers"):
        assert after[table] == before[table] - history[table], table
    assert after["results"] == before["results"] - history["jobs"]
    assert after["timings"] == before["timings"] - history["jobs"]
    with sessions() as session:  # the status counts followed the deletes
        assert counts(session)["jobs"] == {"succeeded": 2, "queued": 2, "running": 1, "failed": 1}
    assert prune(sessions, timedelta(days=30)).jobs == 0  # nothing left to do


def test_a_shorter_cut_off_takes_recent_work_too(database, history):
    sessions = make_sessions(make_db_engine(database))
    report = prune(sessions, timedelta(days=1), dry_run=True)
    # + the job finished lately, the settled batch with its item; the open batch's items still stay
    assert (report.jobs, report.batches) == (len(history["jobs"]) + 2, len(history["batches"]) + 1)


def test_the_prune_command(database, history, monkeypatch):
    monkeypatch.setenv("CONVOQ_DATABASE_URL", database)
    runner = CliRunner()
    before = rows(database)["jobs"]
    dry = runner.invoke(app, ["prune", "--older-than", "30d", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.startswith(f"would delete {len(history['jobs'])} jobs")
    assert json.loads(dry.stdout.splitlines()[-1])["batches"] == 1
    monkeypatch.setenv("CONVOQ_RETENTION_DAYS", "0")  # keep forever: a prune needs its cut-off said
    assert runner.invoke(app, ["prune"]).exit_code == 2
    assert runner.invoke(app, ["prune", "--older-than", "a month"]).exit_code == 2
    monkeypatch.setenv("CONVOQ_RETENTION_DAYS", "30")
    done = runner.invoke(app, ["prune", "--chunk", "2"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout.splitlines()[-1])["jobs"] == len(history["jobs"])
    assert rows(database)["jobs"] == before - history["jobs"]


def test_retention_is_a_month_by_default_and_zero_keeps_everything():
    from jobs.settings import Settings
    from store.retention import retention_period

    assert retention_period(Settings()) == timedelta(days=30)
    assert retention_period(Settings(retention_days=0)) is None
    with pytest.raises(ValueError):
        Settings(retention_days=-1)
