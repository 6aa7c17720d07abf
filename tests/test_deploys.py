"""Deploys and database outages cost the jobs in flight a wait, never a crash: real worker processes.

A crash (`jobs.crashes`) is evidence against a job; only a worker that really died may charge one. A deploy
(SIGTERM, then SIGKILL once compose's grace is spent) hands the jobs back within `CONVOQ_SHUTDOWN_GRACE_S`, and a
PostgreSQL outage longer than a lease leaves every live worker its jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid

import pytest
import redis
import sqlalchemy as sa

from api.http.client import Client
from bench.audit import audit, messages_by_job
from cli.servers import PostgresServer
from cli.stack import Stack
from jobs.schemas import JobIn
from jobs.settings import Settings
from migrations.apply import upgrade
from tests.api_keys import API_KEY
from tests.test_faults import wait_for

pytestmark = pytest.mark.slow

PACED = {"CONVOQ_BACKEND": "tests.paced_backend:create", "CONVOQ_HEARTBEAT_S": "0.5", "CONVOQ_DEAD_AFTER_S": "3",
         "CONVOQ_SWEEP_EVERY_S": "1", "CONVOQ_UNPUBLISHED_GRACE_S": "1", "CONVOQ_WORKER_CONCURRENCY": "4"}


def submit(stack: Stack, n: int, tokens: int) -> list[uuid.UUID]:
    """`n` interactive jobs (every thread may take one) that run `tokens` paced steps."""
    with Client(stack.api_url, API_KEY) as client:
        return [client.submit(JobIn(messages=[{"role": "user", "content": f"Order {i}?"}], priority=8,
                                    sampling={"max_new_tokens": tokens})).id for i in range(n)]


def charged(database_url: str, ids: list[uuid.UUID]) -> dict:
    """Statuses, attempts and crashes of the jobs, and how their runs ended."""
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        jobs = conn.execute(sa.text("SELECT status, attempts, crashes, count(*) FROM jobs WHERE id = ANY(:ids) "
                                    "GROUP BY 1, 2, 3"), {"ids": ids}).all()
        runs = conn.execute(sa.text("SELECT outcome, count(*) FROM runs WHERE job_id = ANY(:ids) GROUP BY 1"),
                            {"ids": ids}).all()
    engine.dispose()
    return {"jobs": sorted(map(tuple, jobs)), "runs": dict(runs)}


def messages(broker_url: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
    client = redis.Redis.from_url(broker_url)
    found = messages_by_job(client, Settings(broker_url=broker_url))
    client.close()
    return {i: len(found.get(i, [])) for i in ids}


def test_a_deploy_hands_the_jobs_back_uncharged_with_their_messages(service_env, database, broker, tmp_path):
    env = {**service_env, **PACED, "CONVOQ_SHUTDOWN_GRACE_S": "60"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        ids = submit(stack, 6, tokens=150)
        first = stack.start_worker()
        wait_for(database, lambda c: c.get("running", 0) == 4, 60, "four running")

        # a deploy whose engine goes away during the grace: the jobs go back, the worker leaves cleanly
        os.kill(first.pid, signal.SIGTERM)  # to the worker alone, as compose signals a container's first process
        engine = subprocess.run(["pgrep", "-P", str(first.pid), "-f", "spawn_main"], capture_output=True, text=True)
        os.kill(int(engine.stdout.split()[0]), signal.SIGKILL)
        assert first.wait(30) == 0  # not the engine-death exit (3), which left the jobs to expire as crashes
        assert charged(database, ids) == {"jobs": [("queued", 0, 0, 6)], "runs": {"returned": 4}}
        assert set(messages(broker, ids).values()) == {1}  # each job's own message, back in the queue

        # the next worker takes them at once; its deploy's grace (1 s) ends before they finish
        stack.env["CONVOQ_SHUTDOWN_GRACE_S"] = "1"
        stack.start_worker()
        wait_for(database, lambda c: c.get("running", 0) == 4, 30, "four running again")
        started = time.monotonic()
        os.kill(stack.workers[-1].pid, signal.SIGTERM)
        stack.workers[-1].wait(60)
        assert time.monotonic() - started < 10 and stack.workers[-1].returncode == 0
        assert charged(database, ids) == {"jobs": [("queued", 0, 0, 6)], "runs": {"returned": 8}}
        assert set(messages(broker, ids).values()) == {1}
    report = audit(sa.create_engine(database), ids)
    assert report["duplicate_executions"] == report["duplicate_results"] == 0, report


def test_a_database_outage_longer_than_a_lease_charges_nothing(service_env, tmp_path):
    pg = PostgresServer().start()
    try:
        upgrade(pg.url)
        env = {**service_env, **PACED, "CONVOQ_DATABASE_URL": pg.url, "CONVOQ_HEARTBEAT_S": "0.4",
               "CONVOQ_DEAD_AFTER_S": "2"}
        with Stack(env, tmp_path / "logs") as stack:
            stack.start_api()
            ids = submit(stack, 4, tokens=450)  # still running when the database is back
            stack.start_worker()
            wait_for(pg.url, lambda c: c.get("running", 0) == 4, 60, "four running")
            pg.stop(remove=False, immediate=True)
            time.sleep(7)  # over three leases: every lease in flight expires while its worker lives
            pg.start()
            wait_for(pg.url, lambda c: c.get("succeeded", 0) == 4, 120, "all four")
            assert stack.workers[-1].poll() is None
        # each ran once, and nothing was charged: neither the sweep nor the worker took the outage for a death
        assert charged(pg.url, ids) == {"jobs": [("succeeded", 1, 0, 4)], "runs": {"succeeded": 4}}
    finally:
        pg.stop()
