"""Fault injection on real processes: worker kills, broker and database restarts, poison jobs.

Each test owns the servers it breaks. Whatever happens, every accepted job must end in exactly one terminal
state, its result written by one run, and no job run again unless the run before it ended with its worker
(`bench.audit` counts runs and refused writes from what the service recorded).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import sqlalchemy as sa

from api.http.client import Client
from bench.audit import audit
from bench.faults import lost_replies_env
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.schemas import JobIn
from jobs.tables import Job
from migrations.apply import upgrade
from tests.api_keys import API_KEY

pytestmark = pytest.mark.slow

FAST_RECOVERY = {"CONVOQ_HEARTBEAT_S": "0.5", "CONVOQ_DEAD_AFTER_S": "3", "CONVOQ_UNPUBLISHED_GRACE_S": "1",
                 "CONVOQ_SWEEP_EVERY_S": "1"}


def job(i: int, content: str | None = None) -> JobIn:
    return JobIn(messages=[{"role": "user", "content": content or f"Where is parcel {i}?"}], priority=i % 10,
                 sampling={"max_new_tokens": 12})


def tally(database_url: str) -> dict[str, int]:
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        by_status = dict(conn.execute(sa.text("SELECT status, count(*) FROM jobs GROUP BY status")).all())
    engine.dispose()
    return by_status


def detail_of(database_url: str, job_id: uuid.UUID) -> str:
    """What raised, as the job's row keeps it for admin keys and operators."""
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        detail = conn.execute(sa.select(Job.error_detail).where(Job.id == job_id)).scalar_one()
    engine.dispose()
    return detail


def clean(database_url: str, ids: list) -> dict[str, int]:
    """The audit of these jobs, checked for what no fault may cause: every job succeeded, each ran once
    unless a run before it ended with its worker, and its result was written once."""
    engine = sa.create_engine(database_url)
    ids = [uuid.UUID(str(i)) for i in ids]
    report = audit(engine, ids)
    with engine.connect() as conn:
        others = conn.execute(sa.select(Job.status, Job.crashes, Job.error)
                              .where(Job.id.in_(ids), Job.status != "succeeded")).all()
    engine.dispose()
    assert report["succeeded"] == len(ids), (report, others)
    assert report["duplicate_results"] == report["duplicate_executions"] == report["stuck"] == 0, report
    return report


def wait_for(database_url: str, predicate, timeout: float, what: str) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            counts = tally(database_url)
        except sa.exc.OperationalError:  # the database itself may be the thing that is down
            counts = {}
        if counts and predicate(counts):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {counts}")
        time.sleep(0.2)


def supervise(stack: Stack, database_url: str, n: int, timeout: float) -> int:
    """Start a worker and keep one running, as a process supervisor would, until `n` jobs are terminal; returns
    how many times it died. One that dies before its log says it is ready (a job it took at once killed it)
    counts like any other."""
    deaths, deadline = 0, time.monotonic() + timeout
    start_worker(stack)
    while sum(tally(database_url).get(s, 0) for s in ("succeeded", "failed")) < n:
        if stack.workers[-1].poll() is not None:
            deaths += 1
            start_worker(stack)
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {timeout}s: {tally(database_url)}")
        time.sleep(0.2)
    return deaths


def start_worker(stack: Stack) -> None:
    """A worker started; if it exits before it is ready, the caller sees it dead."""
    try:
        stack.start_worker()
    except RuntimeError:
        if stack.workers[-1].poll() is None:
            raise


def submit_around(client: Client, poison: str, n: int) -> tuple[list, object]:
    """`n` jobs, the one in the middle with the `poison` prompt: (ids of the others, its id)."""
    ids = [client.submit(job(i, poison if i == n // 2 else None)).id for i in range(n)]
    return ids[:n // 2] + ids[n // 2 + 1:], ids[n // 2]


def submit_all(stack: Stack, n: int) -> list[str]:
    with Client(stack.api_url, API_KEY) as client:
        return [str(client.submit(job(i)).id) for i in range(n)]


def test_worker_killed_twice_loses_nothing_and_duplicates_nothing(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_WORKER_CONCURRENCY": "32", "CONVOQ_MAX_BATCH_SIZE": "8"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        ids = submit_all(stack, 200)
        for target in (30, 100):
            stack.start_worker()
            # killed while it holds jobs (a worker stores a batch's results together, then claims the next)
            wait_for(database, lambda c, t=target: c.get("succeeded", 0) >= t and c.get("running", 0) >= 8, 180,
                     f"{target} done, more running")
            stack.kill_worker(sig=signal.SIGKILL)
        stack.start_worker()
        wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 200, 300, "all 200")
    report = clean(database, ids)
    assert report["executions"] > 200, report  # the kills cut runs short: those jobs ran again, explained by the crash


def test_broker_killed_mid_run(service_env, database, tmp_path):
    redis = RedisServer().start()  # AOF synced every second: a SIGKILL loses up to a second of messages
    try:
        env = {**service_env, **FAST_RECOVERY, "CONVOQ_BROKER_URL": redis.url, "CONVOQ_MAX_BATCH_SIZE": "4",
               "CONVOQ_WORKER_CONCURRENCY": "8"}
        with Stack(env, tmp_path / "logs") as stack:
            stack.start_api()
            ids = submit_all(stack, 80)
            stack.start_worker()
            wait_for(database, lambda c: c.get("succeeded", 0) >= 10, 120, "10 done")
            redis.kill()
            time.sleep(2)
            redis.start()
            wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 80, 300, "all 80")
            assert stack.workers[-1].poll() is None  # the same worker recovered by itself
    finally:
        redis.stop()
    clean(database, ids)


def test_database_stopped_for_longer_than_a_lease(service_env, tmp_path):
    """Stopped for 2.5 times CONVOQ_DEAD_AFTER_S: every lease expires during the outage."""
    pg = PostgresServer().start()
    try:
        upgrade(pg.url)
        env = {**service_env, "CONVOQ_DATABASE_URL": pg.url, "CONVOQ_MAX_BATCH_SIZE": "4",
               "CONVOQ_WORKER_CONCURRENCY": "8", "CONVOQ_SWEEP_EVERY_S": "1",
               "CONVOQ_HEARTBEAT_S": "2", "CONVOQ_DEAD_AFTER_S": "8"}
        with Stack(env, tmp_path / "logs") as stack:
            stack.start_api()
            ids = submit_all(stack, 60)
            stack.start_worker()
            wait_for(pg.url, lambda c: c.get("succeeded", 0) >= 8, 120, "8 done")
            pg.stop(remove=False, immediate=True)
            time.sleep(20)
            pg.start()
            wait_for(pg.url, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 60, 300, "all 60")
            assert stack.workers[-1].poll() is None
        clean(pg.url, ids)
    finally:
        pg.stop()


def test_commits_whose_reply_is_lost_are_recognised_when_retried(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, **lost_replies_env(3)}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        ids = submit_all(stack, 40)
        stack.start_worker()
        wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 40, 180, "all 40")
        log = (tmp_path / "logs" / "worker0.log").read_text()
    # the fault did happen (how often depends on how the worker groups its commits)
    assert log.count("injected: the reply to a COMMIT is lost") >= 2
    report = clean(database, ids)
    assert report["executions"] == 40  # no claim was mistaken for someone else's: each job ran once


def test_a_frozen_worker_loses_its_jobs_and_its_late_writes_are_refused(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.paced_backend:create"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Order {i}?"}], priority=5,
                                       sampling={"max_new_tokens": 100})).id for i in range(6)]
            frozen = stack.start_worker()
            wait_for(database, lambda c: c.get("running", 0) == 6, 60, "all six running")
            os.killpg(frozen.pid, signal.SIGSTOP)  # past its lease: the jobs go to the next worker
            try:
                stack.start_worker()
                done = [client.wait(i, timeout=120) for i in ids]
            finally:
                os.killpg(frozen.pid, signal.SIGCONT)
        engine = sa.create_engine(database)
        deadline = time.monotonic() + 30
        while audit(engine, ids)["stale_writes_refused"] < 6 and time.monotonic() < deadline:
            time.sleep(0.2)  # the woken worker finds its leases gone, stops its runs, and tries to store them
        engine.dispose()
    assert [j.status for j in done] == ["succeeded"] * 6
    report = clean(database, ids)
    assert report["stale_writes_refused"] == 6 and report["executions"] == 12, report


def test_a_job_that_kills_its_worker_fails_alone_and_the_others_succeed(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.poison_backend:create_crash"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            good, poison = submit_around(client, "Please CRASH now", 24)
            deaths = supervise(stack, database, 24, timeout=300)
            bad = client.wait(poison, timeout=10)
    # two crashes make it a suspect; run alone, it crashes the worker once more and is condemned for it
    assert deaths == 3
    assert (bad.status, bad.error_code, bad.error_detail) == ("failed", "crashed", None)  # a tenant's key
    assert "while it ran alone" in detail_of(database, bad.id)
    clean(database, good)  # nobody else was charged: every other job succeeded


def test_poison_job_fails_alone_after_bounded_retries(service_env, database, tmp_path):
    env = {**service_env, "CONVOQ_BACKEND": "tests.poison_backend:create", "CONVOQ_RETRY_BACKOFF_S": "0.5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            good, poison = submit_around(client, "Please summarize POISON for me", 51)
            stack.start_worker()
            done = [client.wait(i, timeout=180) for i in good]
            bad = client.wait(poison, timeout=180)
    assert [j.status for j in done] == ["succeeded"] * 50
    assert bad.status == "failed" and bad.attempts == 3
    assert bad.error_code == "engine_error" and "poisoned input" not in bad.error
    assert "failed after 3 attempts" in (detail := detail_of(database, bad.id)) and "poisoned input" in detail


def test_warm_shutdown_finishes_or_returns_in_flight_jobs(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_WORKER_CONCURRENCY": "16", "CONVOQ_MAX_BATCH_SIZE": "4"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        ids = submit_all(stack, 60)
        stack.start_worker()
        wait_for(database, lambda c: c.get("succeeded", 0) >= 10, 120, "10 done")
        started = time.monotonic()
        stack.kill_worker(sig=signal.SIGTERM)  # warm shutdown: returns once in-flight work is settled
        assert time.monotonic() - started < 60
        assert stack.workers[-1].returncode == 0
        stack.start_worker()
        wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 60, 240, "all 60")
    clean(database, ids)


def test_engine_out_of_memory_exits_the_worker_and_its_jobs_run_elsewhere(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.poison_backend:create_oom"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            ids = [client.submit(job(i)).id for i in range(10)]
            ids.append(client.submit(job(10, "This prompt will OOM the device")).id)
            crashing = stack.start_worker()
            assert crashing.wait(120) == 3  # fails fast and says so, for its supervisor to restart it
            stack.env["CONVOQ_BACKEND"] = "engine"  # the replacement worker has the memory it needs
            stack.start_worker()
            done = [client.wait(i, timeout=120) for i in ids]
    assert [j.status for j in done] == ["succeeded"] * 11
    clean(database, ids)
