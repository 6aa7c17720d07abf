"""Fault injection on real processes: worker kills, broker and database restarts, poison jobs.

Each test owns the servers it breaks. Whatever happens, every accepted job must end in exactly one terminal
state with at most one result row.
"""

from __future__ import annotations

import signal
import time

import pytest
import sqlalchemy as sa

from api.client import Client
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.schemas import JobIn
from migrations.apply import upgrade
from tests.conftest import API_KEY

pytestmark = pytest.mark.slow

FAST_RECOVERY = {"CONVOQ_HEARTBEAT_S": "0.5", "CONVOQ_DEAD_AFTER_S": "3", "CONVOQ_UNPUBLISHED_GRACE_S": "1"}


def job(i: int, content: str | None = None) -> JobIn:
    return JobIn(messages=[{"role": "user", "content": content or f"Where is parcel {i}?"}], priority=i % 10,
                 sampling={"max_new_tokens": 12})


def tally(database_url: str) -> dict[str, int]:
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        by_status = dict(conn.execute(sa.text("SELECT status, count(*) FROM jobs GROUP BY status")).all())
        by_status["results"] = conn.execute(sa.text("SELECT count(*) FROM results")).scalar_one()
        by_status["result_jobs"] = conn.execute(sa.text("SELECT count(DISTINCT job_id) FROM results")).scalar_one()
    engine.dispose()
    return by_status


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


def submit_all(stack: Stack, n: int) -> list[str]:
    with Client(stack.api_url, API_KEY) as client:
        return [str(client.submit(job(i)).id) for i in range(n)]


def test_worker_killed_twice_loses_nothing_and_duplicates_nothing(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_WORKER_CONCURRENCY": "32", "CONVOQ_MAX_BATCH_SIZE": "8"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        submit_all(stack, 200)
        for target in (30, 100):
            stack.start_worker()
            wait_for(database, lambda c, t=target: c.get("succeeded", 0) >= t, 180, f"{target} done")
            stack.kill_worker(sig=signal.SIGKILL)
        stack.start_worker()
        counts = wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 200, 300, "all 200")
    assert counts.get("succeeded") == 200, counts
    assert counts["results"] == counts["result_jobs"] == 200


def test_broker_restart_mid_run(service_env, database, tmp_path):
    redis = RedisServer().start()  # AOF on: queued messages survive the restart
    try:
        env = {**service_env, **FAST_RECOVERY, "CONVOQ_BROKER_URL": redis.url, "CONVOQ_MAX_BATCH_SIZE": "4",
               "CONVOQ_WORKER_CONCURRENCY": "8"}
        with Stack(env, tmp_path / "logs") as stack:
            stack.start_api()
            submit_all(stack, 80)
            stack.start_worker()
            wait_for(database, lambda c: c.get("succeeded", 0) >= 10, 120, "10 done")
            redis.stop(remove=False)
            time.sleep(2)
            redis.start()
            counts = wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 80, 300, "all 80")
            assert stack.workers[-1].poll() is None  # the same worker recovered by itself
    finally:
        redis.stop()
    assert counts.get("succeeded") == 80 and counts["results"] == 80, counts


def test_database_down_for_twenty_seconds(service_env, tmp_path):
    pg = PostgresServer().start()
    try:
        upgrade(pg.url)
        env = {**service_env, "CONVOQ_DATABASE_URL": pg.url, "CONVOQ_MAX_BATCH_SIZE": "4",
               "CONVOQ_WORKER_CONCURRENCY": "8"}
        with Stack(env, tmp_path / "logs") as stack:
            stack.start_api()
            submit_all(stack, 60)
            stack.start_worker()
            wait_for(pg.url, lambda c: c.get("succeeded", 0) >= 8, 120, "8 done")
            pg.stop(remove=False)
            time.sleep(20)
            pg.start()
            counts = wait_for(pg.url, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 60, 300, "all 60")
            assert stack.workers[-1].poll() is None
    finally:
        pg.stop()
    assert counts.get("succeeded") == 60 and counts["results"] == 60, counts


def test_poison_job_fails_alone_after_bounded_retries(service_env, database, tmp_path):
    env = {**service_env, "CONVOQ_BACKEND": "tests.poison_backend:create", "CONVOQ_RETRY_BACKOFF_S": "0.5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            good = [client.submit(job(i)).id for i in range(25)]
            poison = client.submit(job(0, "Please summarize POISON for me")).id
            good += [client.submit(job(i)).id for i in range(25, 50)]
            stack.start_worker()
            done = [client.wait(i, timeout=180) for i in good]
            bad = client.wait(poison, timeout=180)
    assert [j.status for j in done] == ["succeeded"] * 50
    assert bad.status == "failed" and bad.attempts == 3
    assert "failed after 3 attempts" in bad.error and "poisoned input" in bad.error


def test_warm_shutdown_finishes_or_returns_in_flight_jobs(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_WORKER_CONCURRENCY": "16", "CONVOQ_MAX_BATCH_SIZE": "4"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        submit_all(stack, 60)
        stack.start_worker()
        wait_for(database, lambda c: c.get("succeeded", 0) >= 10, 120, "10 done")
        started = time.monotonic()
        stack.kill_worker(sig=signal.SIGTERM)  # warm shutdown: returns once in-flight work is settled
        assert time.monotonic() - started < 60
        assert stack.workers[-1].returncode == 0
        stack.start_worker()
        counts = wait_for(database, lambda c: c.get("succeeded", 0) + c.get("failed", 0) >= 60, 240, "all 60")
    assert counts.get("succeeded") == 60 and counts["results"] == 60, counts


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
    assert tally(database)["results"] == 11
