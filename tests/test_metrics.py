"""Prometheus metrics: the API's scrape against real PostgreSQL and Redis, and the worker's registry."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import fields
from datetime import timedelta

import httpx
import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from api.app import create_app
from api.service.metrics import ServiceCollector, broker_client
from engine.interface import Completion, EngineStats, Timings
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import utcnow
from store.connections import make_db_engine, make_sessions
from tests.api_keys import API_KEY, AUTH, auth
from worker import thread_cpu
from worker.fence import Claimed
from worker.metrics import ENGINE_METRICS, EngineCollector, WorkerMetrics
from worker.outcome import Outcome
from worker.results import Stored, finished_status, timing_row
from worker.thread_cpu import thread_label
from worker.usage import cpu_seconds, process_cpu_s, stat_fields


@pytest.fixture
def settings(database, broker, tiny_model) -> Settings:
    return Settings(database_url=database, broker_url=broker, api_keys=API_KEY, model=str(tiny_model))


def scrape(client: TestClient, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """The figures of a scrape, collected anew first (the metrics' thread collects them every few seconds)."""
    client.app.state.metrics.snapshot.refresh()
    r = client.get("/metrics", headers=headers)  # no API key: scraped like Flower's metrics
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def submit(client: TestClient, priority: int, kind: str = "chat") -> None:
    job = {"messages": [{"role": "user", "content": "Where is my parcel?"}], "priority": priority, "kind": kind}
    assert client.post("/v1/jobs", json=job, headers=AUTH).status_code == 202


def depth(samples: dict, queue: str, priority: int) -> float:
    return samples["convoq_queue_messages", frozenset({"queue": queue, "priority": str(priority)}.items())]


def test_api_metrics_show_depth_per_priority_and_jobs_by_status(settings, database, broker):
    with TestClient(create_app(settings)) as client:
        for priority in (9, 9, 7):
            submit(client, priority)
        for priority in (0, 0, 0, 1):
            submit(client, priority, kind="summarize")
        engine = sa.create_engine(database)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET status = 'succeeded' WHERE priority = 1"))
            conn.execute(sa.text("INSERT INTO batches (id, status, priority, total, metadata, created_at)"
                                 " VALUES (:id, 'in_progress', 1, 0, '{}', now())"), {"id": uuid.uuid4()})
        engine.dispose()
        broker_client = redis.Redis.from_url(broker)
        broker_client.hset("unacked", "delivery-tag", "message")
        # workers' own queues (`broker.affinity`), at two priorities, and a message of another worker's bulk queue
        broker_client.lpush("convoq.interactive@h.1.1", "message")
        broker_client.lpush("convoq.interactive@h.1.1:3", "message")
        broker_client.lpush("convoq.bulk@h.2.1:8", "message")
        broker_client.close()

        samples = scrape(client)

    assert depth(samples, "convoq.interactive", 9) == 2
    assert depth(samples, "convoq.interactive", 7) == 1
    assert depth(samples, "convoq.bulk", 0) == 3
    assert depth(samples, "convoq.bulk", 1) == 1
    levels = [depth(samples, q, p) for q in ("convoq.interactive", "convoq.bulk") for p in range(10)]
    assert sum(levels) == 7 and len(levels) == 20
    assert samples["convoq_broker_unacked_messages", frozenset()] == 1
    assert samples["convoq_home_queue_messages", frozenset({"queue": "convoq.interactive"}.items())] == 2
    assert samples["convoq_home_queue_messages", frozenset({"queue": "convoq.bulk"}.items())] == 1
    assert samples["process_cpu_seconds_total", frozenset()] > 0  # the API process's own, for CPU per job
    assert samples["convoq_jobs", frozenset({"status": "queued"}.items())] == 6
    assert samples["convoq_jobs", frozenset({"status": "succeeded"}.items())] == 1
    assert samples["convoq_jobs", frozenset({"status": "failed"}.items())] == 0
    assert samples["convoq_batches", frozenset({"status": "in_progress"}.items())] == 1


def test_a_scrape_only_reads(settings, database):
    written = []

    def record(_conn, _cursor, statement: str, *_) -> None:
        if not statement.lstrip().upper().startswith(("SELECT", "WITH")):
            written.append(statement)

    def deltas() -> int:
        engine = sa.create_engine(database)
        with engine.connect() as conn:
            n = conn.execute(sa.text("SELECT count(*) FROM status_counts")).scalar_one()
        engine.dispose()
        return n

    with TestClient(create_app(settings)) as client:
        for priority in (9, 5, 1):
            submit(client, priority)
        before = deltas()
        sa.event.listen(sa.Engine, "before_cursor_execute", record)
        try:
            samples = scrape(client)
        finally:
            sa.event.remove(sa.Engine, "before_cursor_execute", record)
    assert written == [] and deltas() == before  # the status counts are folded by the reconciler, not here
    assert samples["convoq_jobs", frozenset({"status": "queued"}.items())] == 3
    assert samples["convoq_api_db_pool_waits_total", frozenset()] == 0
    assert samples["convoq_api_streams", frozenset()] == 0


def test_healthz_reuses_its_connections_and_answers_from_a_short_cache(settings, broker):
    def connections_made() -> int:
        client = redis.Redis.from_url(broker)
        try:
            return client.info("stats")["total_connections_received"]
        finally:
            client.close()

    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").json() == {"database": "ok", "broker": "ok"}
        before = connections_made()
        for _ in range(30):
            assert client.get("/healthz").status_code == 200
        assert connections_made() - before <= 2  # ours, to count: not one per call


def test_database_metrics_survive_an_unreachable_broker(settings):
    down = settings.model_copy(update={"broker_url": SecretStr("redis://127.0.0.1:1/0")})
    sessions = make_sessions(make_db_engine(down.database_url.get_secret_value()))
    names = {m.name for m in ServiceCollector(down, sessions, broker_client(down)).collect()}
    assert names == {"convoq_jobs", "convoq_batches"}


def outcome(finish_reason: str = "stop") -> tuple[Claimed, Outcome]:
    created = utcnow() - timedelta(seconds=3)
    job = JobIn(messages=[{"role": "user", "content": "hi"}], priority=7)
    claimed = Claimed(uuid.uuid4(), job, created, None, 1)
    # the engine's clock starts at the job's creation: 2.1 s waited (broker, claim, engine), first token at 2.25
    timings = Timings(queue_wait_ms=2100, ttft_ms=2250, prefill_ms=150, decode_ms=400, prompt_tokens_reused=32,
                      host_tokens_reused=16, batch_size=5, first_step=3)
    return claimed, Outcome(Completion("r", [1, 2, 3, 4], "text", 64, finish_reason, timings=timings), engine_ms=700)


def stored(claimed: Claimed, done: Outcome) -> Stored:
    """What `results.store` reports for this outcome (without a database)."""
    status = finished_status(done.completion)
    ok = done.completion.ok
    return Stored(status, timing_row(claimed, done, "w", utcnow()) if ok else None)


def test_worker_metrics_observe_a_stored_job():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    claimed, done = outcome()
    metrics.observe(7, stored(claimed, done), 4)
    metrics.snapshot.refresh()
    value = registry.get_sample_value
    p7 = {"priority": "7"}
    assert value("convoq_job_queue_wait_seconds_sum", p7) == pytest.approx(2.1)
    assert value("convoq_job_time_to_first_token_seconds_sum", p7) == pytest.approx(2.25)
    assert value("convoq_job_prefill_seconds_sum", p7) == pytest.approx(0.15)
    assert value("convoq_job_decode_seconds_sum", p7) == pytest.approx(0.4)
    assert 3.0 <= value("convoq_job_end_to_end_seconds_sum", p7) < 10.0
    assert value("convoq_job_end_to_end_seconds_count", p7) == 1
    assert value("convoq_job_batch_size_bucket", {"le": "4.0"}) == 0
    assert value("convoq_job_batch_size_bucket", {"le": "8.0"}) == 1
    assert value("convoq_jobs_finished_total", {"status": "succeeded"}) == 1
    assert value("convoq_generated_tokens_total") == 4
    assert value("convoq_prompt_tokens_reused_total") == 32
    assert value("convoq_host_tokens_reused_total") == 16
    assert value("process_cpu_seconds_total") > 0  # over jobs finished: the worker's CPU per job


def test_worker_metrics_count_failures_retries_cancellations_and_conversation_routes():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    claimed, done = outcome("cancelled")
    metrics.observe(7, stored(claimed, done), 0)
    metrics.retried()
    metrics.gave_up()
    for home in (True, True, False):
        metrics.conversation_job(home)
    value = registry.get_sample_value
    assert value("convoq_conversation_jobs_total", {"queue": "home"}) == 2
    assert value("convoq_conversation_jobs_total", {"queue": "shared"}) == 1
    assert value("convoq_jobs_finished_total", {"status": "cancelled"}) == 1
    assert value("convoq_jobs_finished_total", {"status": "failed"}) == 1
    assert value("convoq_job_retries_total") == 1
    assert value("convoq_job_end_to_end_seconds_count", {"priority": "7"}) is None  # no timings row either
    assert metrics.finished_total() == 2  # whatever the status: the worker row's `jobs_finished`


def test_a_workers_cpu_time_counts_its_engine_process():
    """`worker.usage.cpu_seconds`: this process's CPU time, plus that of the engine process it names (a busy
    child here), which keeps the worker row's CPU per job honest when the engine runs apart."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while (found := stat_fields(child.pid)) is None or process_cpu_s(found[1]) < 0.5:
            assert time.monotonic() < deadline, "the child never used its CPU"
            time.sleep(0.05)
        alone = cpu_seconds(None)
        assert cpu_seconds(child.pid) - alone >= 0.5
        assert cpu_seconds(2**22 + 7) == pytest.approx(alone, abs=0.05)  # no such process: nothing of it
    finally:
        child.kill()
        child.wait()


def spin_for(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_a_workers_cpu_is_counted_by_the_threads_that_spend_it():
    """`convoq_worker_thread_cpu_seconds_total{thread}`: a pool's threads count as one label, by their name
    without its number, and a thread that ended keeps what it had spent at the last read."""
    names = ("line_12", "ThreadPoolExecutor-0_3", "Thread-3 (serve)", "claims", "engine-reader", "MainThread")
    assert [thread_label(n) for n in names] == \
        ["line", "ThreadPoolExecutor", "Thread (serve)", "claims", "engine-reader", "MainThread"]
    registry = CollectorRegistry()
    snapshot = WorkerMetrics(registry).snapshot

    def value(name: str, labels: dict | None = None) -> float | None:
        snapshot.refresh()
        return registry.get_sample_value(name, labels)

    release = threading.Event()

    def work(cpu_s: float) -> None:
        spin_for(cpu_s)
        release.wait(30)

    pool = [threading.Thread(target=work, args=(0.1 * (i + 1),), name=f"spinner_{i}") for i in range(3)]
    for thread in pool:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while (spent := value("convoq_worker_thread_cpu_seconds_total", {"thread": "spinner"}) or 0.0) < 0.6:
            assert time.monotonic() < deadline, f"the spinners' 0.6 s of CPU never showed: {spent}"
            time.sleep(0.05)
        assert spent < 0.6 + 0.2  # their own time, not the process's
        main = value("convoq_worker_thread_cpu_seconds_total", {"thread": "MainThread"})
        assert main is not None and main < value("process_cpu_seconds_total")
    finally:
        release.set()
        for thread in pool:
            thread.join()
    assert value("convoq_worker_thread_cpu_seconds_total", {"thread": "spinner"}) >= spent  # ended, still counted


def test_a_thread_label_keeps_counting_when_the_kernel_gives_an_ended_threads_id_to_a_new_one(monkeypatch):
    """A counter never falls: a pool's thread that ended keeps what it spent, though a later thread of the same
    pool runs under its native id."""
    class Thread:
        def __init__(self, name: str, native_id: int) -> None:
            self.name, self.native_id = name, native_id

    first, second = Thread("line_1", 7), Thread("line_2", 7)
    alive, cpu = [first], {first: 0.5}
    monkeypatch.setattr(threading, "enumerate", lambda: list(alive))
    monkeypatch.setattr(thread_cpu, "thread_cpu_s", lambda native_id: cpu[alive[0]])
    threads = thread_cpu.ThreadCpu()
    assert threads.totals() == {"line": 0.5}
    alive, cpu = [second], {second: 0.1}  # the first ended; the second has its id
    assert threads.totals() == {"line": pytest.approx(0.6)}


def test_engine_gauges_expose_the_stats_the_engine_reports():
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: EngineStats(running=3, kv_usage=0.25, preemptions=2, steps=9)))
    value = registry.get_sample_value
    assert value("convoq_engine_running_requests") == 3
    assert value("convoq_engine_kv_usage_ratio") == 0.25
    assert value("convoq_engine_preemptions_total") == 2
    assert value("convoq_engine_steps_total") == 9
    assert value("convoq_engine_waiting_requests") == 0


def test_every_engine_stat_has_one_metric_and_every_metric_a_stat(monkeypatch):
    assert set(ENGINE_METRICS) == {f.name for f in fields(EngineStats)}
    names = [metric.name for metric in ENGINE_METRICS.values()]
    assert len(set(names)) == len(names) and all(m.kind in ("gauge", "counter") for m in ENGINE_METRICS.values())
    # a field the table lacks is an error at the first collection, never a metric silently left out
    monkeypatch.delitem(ENGINE_METRICS, "waiting")
    with pytest.raises(KeyError, match="waiting"):
        list(EngineCollector(EngineStats).collect())


def two_free_ports() -> int:
    """A port that is free, and so is the next one."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("", port + 1))
                return port
            except OSError:
                continue


def served(port: int, name: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> str:
    """What the metrics served on `port` say once they hold `name` (their thread's first collection is done)."""
    deadline = time.monotonic() + timeout
    while name not in (text := httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers).text):
        assert time.monotonic() < deadline, f"{name} never showed on port {port}: {text[:500]}"
        time.sleep(0.05)
    return text


def test_workers_on_one_host_serve_their_registries_on_ports_of_their_own(monkeypatch):
    port = two_free_ports()
    first = WorkerMetrics.start(port, lambda: EngineStats(waiting=4))
    second = WorkerMetrics.start(port, lambda: EngineStats(waiting=5))  # a second worker with the same setting
    assert (first.served_on, second.served_on) == (port, port + 1)
    assert "convoq_engine_waiting_requests 4.0" in served(port, "convoq_engine_waiting_requests")
    text = served(port + 1, "convoq_engine_waiting_requests")
    assert "convoq_engine_waiting_requests 5.0" in text and "convoq_job_end_to_end_seconds" in text
    monkeypatch.setattr("worker.metrics.PORT_TRIES", 1)
    assert WorkerMetrics.start(port, EngineStats).served_on is None  # every port taken: logged, not raised


def test_our_engines_stats_reach_the_metrics_through_its_thread(tiny_model):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.runtime.engine_thread import EngineThread

    # the worker reads them through the engine thread, which adds its own loop figures
    thread = EngineThread(LLMEngine(EngineConfig(model=str(tiny_model), kv_cache_memory=2**24)))
    stats = thread.stats()
    thread.close()
    assert stats.steps == 0 and stats.kv_blocks_max > 0
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: stats))
    assert registry.get_sample_value("convoq_engine_limited_steps_total") == 0
    assert registry.get_sample_value("convoq_engine_step_fixed_seconds") > 0


# --- a flood of scrapes -------------------------------------------------------------------------------------

def redis_calls(url: str, *commands: str) -> int:
    """How many times Redis ran these commands so far (its own count, whoever sent them)."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in commands)


def test_a_flood_of_scrapes_sends_no_command_to_redis_or_the_database_and_healthz_stays_up(settings, broker):
    """The figures are collected by the metrics' thread (here once, at start), on connections of its own: the
    scrapes read them and nothing else, and the health probe's connection is never waited for."""
    quiet = settings.model_copy(update={"metrics_refresh_s": 3600.0})
    counted: list[str] = []

    def record(_conn, _cursor, statement: str, *_) -> None:
        if "status_counts" in statement:  # what a collection of the job counts reads
            counted.append(statement)

    with TestClient(create_app(quiet)) as client:
        deadline = time.monotonic() + 30
        while "convoq_jobs{" not in client.get("/metrics").text:  # the thread's first collection
            assert time.monotonic() < deadline, "the metrics' thread never collected"
            time.sleep(0.05)
        lists_read = redis_calls(broker, "llen", "scan", "hlen")
        sa.event.listen(sa.Engine, "before_cursor_execute", record)
        scrapes, stop = [], threading.Event()

        def flood() -> None:
            while not stop.is_set():
                scrapes.append(client.get("/metrics").status_code)

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            health = []
            for _ in range(6):  # past the probe's two-second cache: it asks Redis and the database again
                time.sleep(0.5)
                health.append(client.get("/healthz").json())
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            sa.event.remove(sa.Engine, "before_cursor_execute", record)
        after = redis_calls(broker, "llen", "scan", "hlen")
    assert len(scrapes) >= 100 and set(scrapes) == {200}
    assert after == lists_read and counted == []  # not one command for hundreds of scrapes
    assert health == [{"database": "ok", "broker": "ok"}] * 6


def test_the_metrics_key_is_asked_for_when_set(settings):
    keyed = settings.model_copy(update={"metrics_key": SecretStr("metrics-key-0123456789")})
    with TestClient(create_app(keyed)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth("wrong-key-0123456789")).status_code == 401
        assert client.get("/metrics", headers=AUTH).status_code == 401  # an API key is not the metrics key
        samples = scrape(client, auth("metrics-key-0123456789"))
    assert ("convoq_jobs", frozenset({"status": "queued"}.items())) in samples
    with pytest.raises(ValueError, match="at least 16"):
        Settings(metrics_key="short")


def test_the_api_serves_its_metrics_on_a_port_of_their_own_when_told(settings):
    port = two_free_ports()
    apart = settings.model_copy(update={"metrics_port": port})
    with TestClient(create_app(apart)) as client:
        assert client.get("/metrics").status_code == 404  # not on the API's own port
        text = served(port, "convoq_jobs{")
    assert 'convoq_jobs{status="queued"} 0.0' in text and "process_cpu_seconds_total" in text
    with pytest.raises(httpx.ConnectError):  # closed with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics")


def test_a_flood_of_a_workers_scrapes_asks_its_engine_nothing():
    asked = []

    def stats() -> EngineStats:
        asked.append(1)  # a round trip to the engine's process
        return EngineStats(waiting=2)

    port = two_free_ports()
    WorkerMetrics.start(port, stats, refresh_s=3600.0)
    served(port, "convoq_engine_waiting_requests 2.0")
    before = len(asked)
    for _ in range(50):
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    assert before == 1 and len(asked) == before
