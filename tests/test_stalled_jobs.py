"""Jobs of a stalled engine: a cancel or a deadline still ends them while it is stuck; once the watchdog kills it
they go back to the queue charged nothing, unless the same job stalls an engine again, and one that stalls it
while running alone fails at once; a completion that comes after the hand-back writes nothing; the job goes out
again once, with no second message from a sweep; and the worker carries on with a new engine (on a real
PostgreSQL and Redis, and the service as processes)."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from transformers import AutoTokenizer

from api.http.client import Client
from bench.audit import audit
from bench.chaos import engine_of
from broker.app import create_celery
from cli.stack import Stack
from engine.runtime.engine_process import EngineProcess
from jobs.error_codes import ErrorCode
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.status import JobStatus
from tests.api_keys import API_KEY
from tests.test_faults import FAST_RECOVERY, wait_for
from tests.test_leases import done, new_job, row, runs
from worker import results
from worker.bridge import Bridge
from worker.claims import claim, claim_many, mark_alone
from worker.engine_factory import WorkerSettings, load_backend
from worker.run_ends import fail, give_back, record_stall, requeue
from worker.sweep import Sweeper

QUEUED, FAILED = JobStatus.queued, JobStatus.failed


def test_a_stall_hands_its_jobs_back_uncharged_unless_the_same_job_stalls_again(db):
    engine, sessions = db
    job, beside = new_job(sessions), new_job(sessions)
    first = claim_many(sessions, [job, beside], "w1", 3)
    assert record_stall(sessions, first, max_crashes=3) == {c.job_id: QUEUED for c in first}
    assert row(engine, job)[:3] == ("queued", 0, 0)  # neither an attempt nor a crash
    assert runs(engine, job) == [("w1", "stalled", 0)]

    # its second stalled run charges it a crash; a job beside it for the first time is not charged
    newcomer = new_job(sessions)
    second = claim_many(sessions, [job, newcomer], "w1", 3)
    assert record_stall(sessions, second, max_crashes=3) == {c.job_id: QUEUED for c in second}
    assert row(engine, job)[:3] == ("queued", 0, 1) and row(engine, newcomer)[:3] == ("queued", 0, 0)
    # retried after its reply was lost, the write recognises itself and charges nothing twice
    assert record_stall(sessions, second, max_crashes=3) == {c.job_id: QUEUED for c in second}
    assert row(engine, job)[2] == 1 and runs(engine, job)[-1] == ("w1", "stalled", 0)

    # the crashes feed the suspect rules: at CONVOQ_MAX_CRASHES the job fails
    third = claim(sessions, job, "w1", 3)
    assert third.crashes == 1 and record_stall(sessions, [third], 3) == {third.job_id: QUEUED}
    fourth = claim(sessions, job, "w1", 3)
    assert record_stall(sessions, [fourth], 3) == {fourth.job_id: FAILED}
    status, attempts, crashes, error, *_ = row(engine, job)
    assert (status, attempts, crashes) == ("failed", 1, 3) and "stalled" in error

    # a run that lost its job writes nothing
    stale = second[1]
    claim(sessions, newcomer, "w2", 3)
    assert record_stall(sessions, [stale], 3) == {}
    assert row(engine, newcomer)[0] == "running" and runs(engine, newcomer)[0] == ("w1", "stalled", 1)

    # every crash charged here is explained by a repeated stall; one nothing explains is counted
    ids = [uuid.UUID(i) for i in (job, beside, newcomer)]
    assert audit(engine, ids)["crashes_uncaused"] == 0
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET crashes = 1 WHERE id = :i"), {"i": uuid.UUID(beside)})
    assert audit(engine, ids)["crashes_uncaused"] == 1


def test_a_job_that_stalls_its_engine_while_it_runs_alone_is_condemned(db):
    """Alone, the stall is its doing, as a worker's death while it runs alone is: it fails at its first such
    stall, charged the crash, instead of stalling engines (a reload each) until its crashes run out."""
    engine, sessions = db
    suspect = new_job(sessions, crashes=1)
    claimed = claim(sessions, suspect, "w1", 3)
    assert mark_alone(sessions, claimed)
    assert record_stall(sessions, [claimed], max_crashes=5) == {claimed.job_id: FAILED}
    status, attempts, crashes, detail, *_ = row(engine, suspect)
    assert (status, attempts, crashes) == ("failed", 1, 2) and "while it ran alone" in detail
    assert runs(engine, suspect) == [("w1", "stalled", 0)]
    assert record_stall(sessions, [claimed], max_crashes=5) == {claimed.job_id: FAILED}  # a retried write
    assert row(engine, suspect)[2] == 2
    # the same suspect beside others (not alone) goes back as any stall's first
    other = new_job(sessions, crashes=1)
    shared = claim(sessions, other, "w1", 3)
    assert record_stall(sessions, [shared], max_crashes=5) == {shared.job_id: QUEUED}
    assert row(engine, other)[:3] == ("queued", 0, 1)
    assert audit(engine, [uuid.UUID(suspect)], dead_workers=set())["crashes_uncaused"] == 1  # its earlier crash
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET crashes = 1 WHERE id = :i"), {"i": uuid.UUID(suspect)})
    assert audit(engine, [uuid.UUID(suspect)], dead_workers=set())["crashes_uncaused"] == 0  # the stall's own


def test_a_completion_after_its_stall_hand_back_writes_nothing_and_says_so(db):
    """The hand-back keeps the run's lease (so that it recognises its own retried write): a late result, retry or
    failure of the same run finds its job queued under that lease, which is not its own earlier write."""
    engine, sessions = db
    job = new_job(sessions)
    claimed = claim(sessions, job, "w1", 3)
    assert record_stall(sessions, [claimed], max_crashes=3) == {claimed.job_id: QUEUED}
    stored = results.store(sessions, claimed, done(job), "w1")
    assert not stored.applied and stored.timing is None
    assert not requeue(sessions, claimed, "late")
    assert not fail(sessions, claimed, ErrorCode.engine_error, "late")
    assert not give_back(sessions, claimed)
    assert row(engine, job)[0] == "queued"
    assert runs(engine, job) == [("w1", "stalled", 4)]  # each refused write counted on the run
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM results WHERE job_id = :i"),
                            {"i": uuid.UUID(job)}).scalar_one() == 0


def test_a_sweep_sends_no_second_message_for_a_job_its_worker_just_put_back(db, settings):
    """A retry (sent again with its backoff) and a stall's hand-back (sent again at once) are published by the
    worker that put them back; an hour-old job must not look to a sweep as one never sent. A job whose lease
    expired is the sweep's to send, at once."""
    engine, sessions = db
    retried, stalled_job, expired = (new_job(sessions) for _ in range(3))
    ids = [uuid.UUID(i) for i in (retried, stalled_job, expired)]
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET created_at = now() - interval '1 hour' WHERE id = ANY(:ids)"),
                     {"ids": ids})
    retry, stall, _ = claim_many(sessions, [retried, stalled_job, expired], "w1", 3)
    assert requeue(sessions, retry, "the engine failed")
    assert record_stall(sessions, [stall], max_crashes=3, sends=True) == {stall.job_id: QUEUED}
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = :i"),
                     {"i": uuid.UUID(expired)})
    graced = settings.model_copy(update={"unpublished_grace_s": 30})
    swept = Sweeper(sessions, create_celery(graced), graced).sweep(force=True)
    assert (swept["handed_back"], swept["published"], swept["awaiting_confirmation"]) == (1, 1, 0)
    with engine.connect() as conn:
        unpublished = conn.execute(sa.text("SELECT id FROM jobs WHERE published_at IS NULL AND id = ANY(:ids)"),
                                   {"ids": ids}).scalars().all()
    assert unpublished == []  # the expired one sent, the two others stamped when they went back


def paced_engine(model: str):
    return load_backend(WorkerSettings(model=model, backend="tests.paced_backend:create", device="cpu"))


def test_a_cancel_and_a_deadline_end_runs_while_their_engine_is_frozen(tiny_model):
    runner = EngineProcess(functools.partial(paced_engine, str(tiny_model)), AutoTokenizer.from_pretrained(tiny_model))
    bridge = Bridge(runner, Settings(), stop_grace_s=1.0)
    now = datetime.now(UTC)
    job = JobIn(messages=[{"role": "user", "content": "Where is my parcel?"}], priority=9,
                sampling={"max_new_tokens": 1000})  # prompt and output fit the context
    seen: list[list[int]] = []
    outcome: dict = {}

    def expiring() -> None:
        with bridge.run("soon", job, now, deadline_at=now + timedelta(seconds=3)) as run:
            outcome["soon"] = run.submit(None, [5, 6, 7], stream=True).result(30)

    try:
        with bridge.run("asked", job, now, on_tokens=seen.append) as run:
            future = run.submit(None, [1, 2, 3], stream=True)
            other = threading.Thread(target=expiring)
            other.start()
            while (not seen or len(seen[-1]) < 8) and not future.done():
                time.sleep(0.01)
            assert not future.done(), future.exception() or future.result()  # it ended before 8 tokens
            os.kill(runner.pid, signal.SIGSTOP)  # the engine answers nothing from here on
            stopped = time.monotonic()
            assert bridge.stop(["asked"]) == ["asked"]
            asked = future.result(10)
            assert 1 <= time.monotonic() - stopped < 3
            # it ends with the reason and the text it had seen
            assert asked.finish_reason == "cancelled" and asked.token_ids == seen[-1]
            assert asked.text == runner.tokenizer.decode(seen[-1], skip_special_tokens=True)
            other.join(30)
            # due at 3 s, past it by the grace while its engine was frozen: expired without the engine
            assert outcome["soon"].finish_reason == "expired" and datetime.now(UTC) - now < timedelta(seconds=6)
            os.kill(runner.pid, signal.SIGCONT)
            time.sleep(0.5)  # the engine's own word comes late and is dropped
            assert future.result() is asked
    finally:
        os.kill(runner.pid, signal.SIGCONT)
        bridge.close()


def test_a_worker_whose_engine_freezes_ends_the_cancelled_job_and_reruns_the_rest(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.paced_backend:create",
           "CONVOQ_ENGINE_STALL_S": "5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        worker = stack.start_worker()
        with Client(stack.api_url, API_KEY) as client:
            ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Order {i}?"}], priority=9,
                                       deadline_s=60, sampling={"max_new_tokens": 100})).id for i in range(4)]
            wait_for(database, lambda c: c.get("running", 0) == 4, 60, "all four running")
            time.sleep(1)
            frozen = engine_of(worker.pid)
            os.kill(frozen, signal.SIGSTOP)
            frozen_at = time.monotonic()
            client.cancel(ids[0])
            cancelled = client.wait(ids[0], timeout=10)  # within the grace, long before the watchdog acts
            ended_in = time.monotonic() - frozen_at
            done = [client.wait(i, timeout=60) for i in ids[1:]]
        assert worker.poll() is None and engine_of(worker.pid) not in (None, frozen)
    assert cancelled.status == "cancelled" and cancelled.result.finish_reason == "cancelled"
    assert ended_in < 4.5, ended_in  # the bridge's own 3 s, not the watchdog's restart at 5
    assert [j.status for j in done] == ["succeeded"] * 3
    engine = sa.create_engine(database)
    report = audit(engine, [uuid.UUID(str(i)) for i in ids], dead_workers=set())
    with engine.connect() as conn:
        outcomes = conn.execute(sa.text("SELECT outcome, count(*) FROM runs GROUP BY outcome")).all()
        charged = conn.execute(sa.text("SELECT sum(crashes), sum(attempts) FROM jobs")).one()
    engine.dispose()
    assert dict(outcomes) == {"cancelled": 1, "stalled": 3, "succeeded": 3}
    assert tuple(charged) == (0, 4)  # a stall is neither a crash nor an attempt
    assert report["duplicate_executions"] == report["duplicate_results"] == report["crashes_uncaused"] == 0


def test_a_stalled_engine_thread_hands_its_jobs_back_and_ends_its_worker(service_env, database, tmp_path):
    """A thread cannot be killed: its worker hands the jobs back and exits, for its supervisor to restart it."""
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.poison_backend:create_hang",
           "CONVOQ_ENGINE_PROCESS": "false", "CONVOQ_ENGINE_STALL_S": "2"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Please HANG {i}" if i == 2 else
                                                  f"Order {i}?"}], priority=3, sampling={"max_new_tokens": 8})).id
                   for i in range(5)]
            assert stack.start_worker().wait(60) == 3
            assert wait_for(database, lambda c: c.get("queued", 0) + c.get("succeeded", 0) == 5, 10, "handed back")
            stack.env["CONVOQ_BACKEND"] = "hf"  # the next worker's engine does not hang
            stack.env["CONVOQ_ENGINE_STALL_S"] = "120"  # nor is a slow step of it, on a loaded machine, a stall
            stack.start_worker()
            done = [client.wait(i, timeout=60) for i in ids]
    assert [j.status for j in done] == ["succeeded"] * 5
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        outcomes = dict(conn.execute(sa.text("SELECT outcome, count(*) FROM runs GROUP BY outcome")).all())
        charged = conn.execute(sa.text("SELECT sum(crashes) FROM jobs")).scalar_one()
    engine.dispose()
    assert outcomes["stalled"] >= 1 and outcomes["succeeded"] == 5 and charged == 0
