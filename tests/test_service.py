"""The whole path on real processes: HTTP API -> Postgres + Redis -> Celery worker -> engine -> Postgres."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import redis

from api.http.client import Client
from cli.stack import Stack
from jobs.schemas import JobIn
from tests.api_keys import API_KEY
from tests.sql import sql
from tests.test_metrics import two_free_ports

pytestmark = pytest.mark.slow


def chat(i: int, priority: int = 5, kind: str = "chat") -> JobIn:
    return JobIn(messages=[{"role": "user", "content": f"My order #{i} has not arrived yet."}], kind=kind,
                 priority=priority, sampling={"max_new_tokens": 8})


def test_twenty_jobs_end_to_end(stack, database):
    with Client(stack.api_url, API_KEY) as client:
        ids = [client.submit(chat(i, priority=i % 10, kind="summarize" if i % 4 == 0 else "chat")).id
               for i in range(20)]
        jobs = [client.wait(i, timeout=120) for i in ids]
    assert [j.status for j in jobs] == ["succeeded"] * 20
    for job in jobs:
        assert job.result is not None and job.result.completion_tokens > 0 and job.result.text
        assert job.timings is not None and job.timings.batch_size >= 1
        assert job.timings.end_to_end_ms >= job.timings.engine_ms > 0
        assert job.attempts == 1 and job.worker is None and job.started_at and job.finished_at  # a tenant's key
    assert sql(database, "SELECT count(*) FROM jobs WHERE worker IS NULL")[0][0] == 0  # recorded for operators
    assert sql(database, "SELECT count(*) FROM results")[0][0] == 20
    assert sql(database, "SELECT count(*) FROM timings")[0][0] == 20


def test_urgent_jobs_overtake_queued_bulk_work(service_env, database, tmp_path):
    """40 bulk jobs at priority 1 wait in Redis before 5 summaries at priority 9; the 5 still finish first.

    The engine runs at most 4 sequences at a time here, so that priority decides who runs, not just who starts;
    the worker has 8 threads, so that, as in a deployment whose bulk work outnumbers its threads, the bulk gate
    holds most of the bulk jobs in Redis (with 256 threads every job reached the engine at once, and on a loaded
    machine the urgent ones' prompts could reach it seconds after the bulk ones').
    """
    env = {**service_env, "CONVOQ_MAX_NUM_SEQS": "4", "CONVOQ_WORKER_CONCURRENCY": "8"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            bulk = [client.submit(chat(i, priority=1, kind="summarize")).id for i in range(40)]
            urgent = [client.submit(chat(i, priority=9, kind="summarize")).id for i in range(5)]
            stack.start_worker()  # nothing ran before: every message is waiting in Redis
            done = {i: client.wait(i, timeout=180) for i in bulk + urgent}
    assert all(j.status == "succeeded" for j in done.values())
    last_urgent = max(done[i].finished_at for i in urgent)
    overtaken = sum(done[i].finished_at > last_urgent for i in bulk)
    assert overtaken >= 30, f"only {overtaken} of 40 bulk jobs finished after the urgent ones"


def test_flower_sees_the_worker_and_its_tasks(service_env, tmp_path):
    env = {**service_env, "CONVOQ_FLOWER_USER": "oncall", "CONVOQ_FLOWER_PASSWORD": "s3cret"}
    with Stack(env, tmp_path / "logs") as stack:
        flower = stack.start_flower()
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, API_KEY) as client:
            ids = {str(client.submit(chat(i)).id) for i in range(3)}
            for i in ids:
                assert client.wait(i, timeout=120).status == "succeeded"
        auth = ("oncall", "s3cret")
        assert httpx.get(f"{flower}/api/workers", timeout=10).status_code == 401
        # Task states come from the worker's events, sent over Redis pub/sub at most once (under load Flower may
        # miss one: a task then stays STARTED); the worker's own count of what it ran comes from remote control,
        # a request and its reply
        deadline = time.monotonic() + 60
        while True:
            workers = httpx.get(f"{flower}/api/workers", params={"refresh": "true"}, auth=auth, timeout=30).json()
            tasks = httpx.get(f"{flower}/api/tasks", auth=auth, timeout=10).json()
            ran = sum(info.get("stats", {}).get("total", {}).get("convoq.run_job", 0) for info in workers.values())
            if (ran >= len(ids) and ids <= set(tasks)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert any(name.startswith("convoq-") for name in workers), workers
        assert ran == len(ids), workers
        assert ids <= set(tasks), tasks
        assert {tasks[t]["state"] for t in ids} <= {"STARTED", "SUCCESS"} and "SUCCESS" in {tasks[t]["state"] for t in ids}
        assert all(tasks[t]["name"] == "convoq.run_job" for t in ids)
        # on-call tells a chat from a bulk summary at a glance: the message carries the job's kind and priority
        assert all("'kind': 'chat'" in tasks[t]["kwargs"] and "'priority': " in tasks[t]["kwargs"] for t in ids)
        # and the queues' lengths, read from Redis by the broker URL's scheme (`broker.redis_transport` keeps it)
        lengths = httpx.get(f"{flower}/api/queues/length", auth=auth, timeout=10)
        assert lengths.status_code == 200, lengths.text
        assert "convoq.interactive" in {q["name"] for q in lengths.json()["active_queues"]}


def test_two_workers_on_one_host_get_node_names_and_metrics_ports_of_their_own(service_env, tmp_path):
    from broker.app import create_celery
    from jobs.settings import Settings

    port = two_free_ports()
    env = {**service_env, "CONVOQ_WORKER_METRICS_PORT": str(port), "CONVOQ_WORKER_CONCURRENCY": "2"}
    celery = create_celery(Settings(broker_url=service_env["CONVOQ_BROKER_URL"]))
    with Stack(env, tmp_path / "logs") as stack:
        workers = [stack.start_worker(), stack.start_worker()]
        expected = {f"convoq-{w.pid}@{socket.gethostname()}" for w in workers}
        deadline = time.monotonic() + 60
        while (names := {n for reply in celery.control.ping(timeout=2) for n in reply}) != expected:
            assert time.monotonic() < deadline, names
        served = [httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text for p in (port, port + 1)]
        assert all("convoq_engine_running_requests" in text for text in served)


@pytest.mark.parametrize("home", [False, True], ids=["shared-queue", "own-queue"])
def test_an_urgent_message_is_fetched_while_bulk_holds_the_worker(service_env, database, tmp_path, home):
    """Bulk jobs that run for minutes may hold at most 3 of a worker's 4 threads: the fourth takes the urgent job.
    Bulk jobs of conversations wait in the worker's own bulk queue (`broker.affinity`), which the gate holds too."""
    env = {**service_env, "CONVOQ_BACKEND": "tests.slow_backend:create", "CONVOQ_WORKER_CONCURRENCY": "4"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, API_KEY) as client:
            for i in range(8):
                job = chat(i, priority=1, kind="summarize")
                client.submit(job.model_copy(update={"conversation_id": f"c{i}"}) if home else job)

            def running() -> int:
                return sql(database, "SELECT count(*) FROM jobs WHERE status = 'running'")[0][0]

            deadline = time.monotonic() + 30
            while running() < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # had the worker taken a fourth bulk message, it would have claimed it by now
            assert running() == 3
            if home:  # the other five wait in the worker's own bulk queue, which the gate holds as the shared one
                broker = redis.Redis.from_url(service_env["CONVOQ_BROKER_URL"])
                assert sum(broker.llen(k) for k in broker.scan_iter("convoq.bulk@*")) == 5
                broker.close()
            start = time.monotonic()
            urgent = client.wait(client.submit(chat(99, priority=9)).id, timeout=30)
            waited = time.monotonic() - start
        assert urgent.status == "succeeded" and waited < 10
        bulk = [status for (status,) in sql(database, "SELECT status FROM jobs WHERE priority = 1")]
        assert bulk.count("running") == 3 and bulk.count("queued") == 5, bulk
