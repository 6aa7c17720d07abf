"""Bulk lines travel in grouped messages: claimed in one statement, stored in one write, acknowledged together,
each line settled on its own; interactive jobs keep a message each."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import insert

from api.http.client import Client
from bench.audit import messages_by_job
from bench.statements import Statements
from broker.app import create_celery
from broker.publish import publish
from broker.view import GROUP_HEADER, message_headers
from cli.stack import Stack
from engine.interface import EngineStalled
from engine.runtime.engine_thread import EngineThread
from jobs.queues import TASK_RUN_GROUP, TASK_RUN_JOB
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Job, job_row, utcnow
from store.connections import make_db_engine, make_sessions
from tests.api_keys import API_KEY
from tests.engine_helpers import make_engine
from tests.test_batches import upload, wait_settled
from tests.test_faults import FAST_RECOVERY, clean, supervise
from worker import results, runs
from worker.bridge import Bridge
from worker.bulk_gate import bulk_gate
from worker.claims import claim_many
from worker.fence import Claimed
from worker.group_commit import GroupCommit
from worker.runs import run_together

pytestmark = pytest.mark.usefixtures("single_thread")


def sent_messages(broker_url: str) -> list[dict]:
    client = redis.Redis.from_url(broker_url)
    raw = [m for key in client.keys("convoq.*") for m in client.lrange(key, 0, -1)]
    client.close()
    return [message_headers(m) for m in raw]


def test_bulk_lines_are_grouped_by_batch_and_interactive_jobs_travel_alone(database, broker):
    settings = Settings(broker_url=broker, database_url=database, bulk_group=16)
    celery = create_celery(settings)
    first, second = uuid.uuid4(), uuid.uuid4()
    lines = [SimpleNamespace(id=uuid.uuid4(), kind="chat", priority=2, batch_id=b) for b in [first] * 40 + [second] * 3]
    urgent = [SimpleNamespace(id=uuid.uuid4(), kind="chat", priority=p, batch_id=first) for p in (7, 9)]
    loose = [SimpleNamespace(id=uuid.uuid4(), kind="chat", priority=1, batch_id=None)]
    with make_sessions(make_db_engine(database))() as session:
        sent = publish(celery, session, [*lines, *urgent, *loose], settings)
    assert sorted(sent) == sorted(j.id for j in [*lines, *urgent, *loose])
    headers = sent_messages(broker)
    groups = [h[GROUP_HEADER] for h in headers if h["task"] == TASK_RUN_GROUP]
    alone = [h["id"] for h in headers if h["task"] == TASK_RUN_JOB]
    # 40 lines of one batch: 16 + 16 + 8; the other batch's 3 are a group of their own
    assert sorted(map(len, groups)) == [3, 8, 16, 16]
    assert all(len({str(j.batch_id) for j in lines if str(j.id) in g}) == 1 for g in groups)
    assert sorted(alone) == sorted(str(j.id) for j in [*urgent, *loose])  # interactive, or no batch: never grouped
    # what Flower shows of each: a job's id, a group's count and first id; the kind and priority of both
    assert all(h["argsrepr"] == repr([h["id"]]) for h in headers if h["task"] == TASK_RUN_JOB)
    assert all(h["argsrepr"] == f"[{len(h[GROUP_HEADER])} jobs: {h[GROUP_HEADER][0]}, ...]"
               for h in headers if h["task"] == TASK_RUN_GROUP)
    assert {h["kwargsrepr"] for h in headers} == {repr({"kind": "chat", "priority": p}) for p in (1, 2, 7, 9)}
    client = redis.Redis.from_url(broker)
    found = messages_by_job(client, settings)  # the broker's view finds every line of a group
    client.close()
    assert sorted(found) == sorted(sent) and all(len(m) == 1 for m in found.values())


def queued_jobs(sessions, n: int) -> list[str]:
    rows = [job_row(JobIn(messages=[{"role": "user", "content": f"line {i}"}], priority=1), utcnow())
            for i in range(n)]
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), rows)
    return [str(row["id"]) for row in rows]


def test_a_group_is_claimed_in_one_statement_and_a_bad_line_fails_alone(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    ids = queued_jobs(sessions, 16)
    statements = Statements(engine)
    writer = GroupCommit(lambda batch: claim_many(sessions, batch, "w1", 3), "claims")
    claimed = [f.result() for f in writer.many(ids)]
    assert [str(c.job_id) for c in claimed] == ids and len({c.lease for c in claimed}) == 1
    assert len(statements.take()) == 1  # one statement for the whole group, its runs rows included

    # a line whose write raises is written again alone; the rest of its group commits without it
    bad = "not-a-uuid"
    futures = writer.many([*queued_jobs(sessions, 3), bad])
    assert all(f.result() is not None for f in futures[:3])
    with pytest.raises(ValueError):
        futures[3].result()
    writer.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs WHERE status = 'running'")).scalar_one() == 19


def line_with(i: int, content: str) -> bytes:
    return json.dumps({"custom_id": f"req-{i:03d}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "qwen3", "max_tokens": 4,
                                "messages": [{"role": "user", "content": content}]}}).encode()


def batch_job_ids(database: str) -> dict[str, uuid.UUID]:
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT custom_id, id FROM jobs")).all())
    engine.dispose()
    return rows


@pytest.mark.slow
def test_a_poison_line_fails_alone_in_its_group(service_env, database, tmp_path):
    env = {**service_env, "CONVOQ_BACKEND": "tests.poison_backend:create", "CONVOQ_RETRY_BACKOFF_S": "0.5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        stack.start_worker()
        with Client(stack.api_url, API_KEY) as client:
            batch = client.create_batch(upload(32, bad={10: line_with(10, "Please summarize POISON for me")}))
            done = wait_settled(client, batch.id, timeout=240)
    assert (done.request_counts.completed, done.request_counts.failed) == (31, 1), done
    ids = batch_job_ids(database)
    poison = ids.pop("req-010")
    clean(database, list(ids.values()))  # each other line ran once, its result written once
    engine = sa.create_engine(database)
    with engine.connect() as conn:
        status, attempts = conn.execute(sa.text("SELECT status, attempts FROM jobs WHERE id = :i"),
                                        {"i": poison}).one()
    engine.dispose()
    assert (status, attempts) == ("failed", 3)


@pytest.mark.slow
def test_a_group_whose_worker_dies_is_run_again_without_doubles(service_env, database, tmp_path):
    env = {**service_env, **FAST_RECOVERY, "CONVOQ_BACKEND": "tests.poison_backend:create_crash"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        with Client(stack.api_url, API_KEY) as client:
            batch = client.create_batch(upload(24, bad={12: line_with(12, "Please CRASH now")}))
            deadline = time.monotonic() + 60
            while client.get_batch(batch.id).status == "validating":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            deaths = supervise(stack, database, 24, timeout=300)
    assert deaths == 3  # the crashing line, a suspect after two, is condemned running alone
    ids = batch_job_ids(database)
    ids.pop("req-012")
    clean(database, list(ids.values()))  # its group's other lines went back and ran once more, none twice


def test_the_bulk_gate_counts_a_group_by_its_lines():
    gate = object.__new__(bulk_gate(["convoq.bulk"], 0.75))  # its state alone: no consumer, no signals
    gate.held, gate.lines, gate.holding, gate.gated, gate.c = Counter(), {}, 0, None, None
    bulk = {"routing_key": "convoq.bulk"}
    gate._received(request=SimpleNamespace(id="g", task_name=TASK_RUN_GROUP, args=[["a", "b", "c"]],
                                           delivery_info=bulk))
    gate._received(request=SimpleNamespace(id="j", task_name=TASK_RUN_JOB, args=["d"], delivery_info=bulk))
    gate._received(request=SimpleNamespace(id="u", task_name=TASK_RUN_JOB, args=["e"],
                                           delivery_info={"routing_key": "convoq.interactive"}))
    assert gate.holding == 4  # the group's three lines and the bulk job; the urgent one is not bulk's
    gate._finished("g")
    assert gate.holding == 1 and "g" not in gate.lines


class Recorder:
    """What a worker's context records of a group's run: statuses published, writes handed to the store, and
    whether anything went to the lines' thread pool."""

    def __init__(self) -> None:
        self.statuses: list[tuple[str, str]] = []
        self.stored: list[tuple[Claimed, object]] = []
        self.pooled: list[str] = []

    def status(self, job_id: str, status) -> None:
        self.statuses.append((job_id, status.value))

    def many(self, done: list) -> list[Future]:
        self.stored += done
        futures = [Future() for _ in done]
        for (_, outcome), future in zip(done, futures, strict=True):
            future.set_result(results.Stored(results.finished_status(outcome.verdict), None))
        return futures

    def map(self, fn, items):
        self.pooled += [str(c.job_id) for c in items]
        return [fn(c) for c in items]


def worker_context(bridge: Bridge, recorder: Recorder) -> SimpleNamespace:
    return SimpleNamespace(
        bridge=bridge, lines=recorder, store=recorder, settings=Settings(),
        progress=SimpleNamespace(status=recorder.status, tokens=lambda *_: None),
        shutdown=SimpleNamespace(over=threading.Event(), begun=threading.Event()),
        metrics=SimpleNamespace(observe=lambda *_: None, refused=lambda: None))


def claimed(job: JobIn) -> Claimed:
    return Claimed(uuid.uuid4(), job, utcnow(), uuid.uuid4(), 1, lease=uuid.uuid4())


def test_a_group_of_single_answer_chats_runs_on_its_own_thread_all_in_the_engine_at_once(tiny_model):
    bridge = Bridge(EngineThread(make_engine(tiny_model)), Settings())
    recorder = Recorder()
    ctx = worker_context(bridge, recorder)
    chats = [claimed(JobIn(messages=[{"role": "user", "content": f"Where is parcel {i}?"}], priority=1,
                           sampling={"max_new_tokens": 6})) for i in range(5)]
    too_long = claimed(JobIn(messages=[{"role": "user", "content": "word " * 5000}], priority=1))
    group = [*chats[:2], too_long, *chats[2:]]
    try:
        assert run_together(ctx, group, alone=False) is False
        assert recorder.pooled == []  # no thread of the pool: every line ran on the group's thread
        outcomes = {c.job_id: o for c, o in recorder.stored}
        assert list(outcomes) == [c.job_id for c in group]  # each line stored, in its group's order
        assert all(outcomes[c.job_id].verdict.ok and outcomes[c.job_id].completion.text for c in chats)
        # the lines ran side by side in the engine, as a thread each would have had them
        assert all(outcomes[c.job_id].completion.timings.batch_size == len(chats) for c in chats)
        assert "context" in outcomes[too_long.job_id].verdict.error  # the line that cannot run fails alone
        assert recorder.statuses[:len(group)] == [(str(c.job_id), "running") for c in group]  # all asked first
        assert recorder.statuses[len(group):] == [(str(c.job_id), "failed" if c is too_long else "succeeded")
                                                  for c in group]
        assert bridge.running() == []  # every line's run left the bridge

        # lines that wait on each other in the engine (a chat's further choices, a summary's levels) keep a thread
        # each, so that one line's wait does not hold the next one's requests back
        recorder.stored.clear()
        several = claimed(JobIn(messages=[{"role": "user", "content": "Two answers, please."}], priority=1, n=2,
                                sampling={"max_new_tokens": 4}))
        run_together(ctx, [chats[0], several], alone=False)
        assert recorder.pooled == [str(chats[0].job_id), str(several.job_id)]
        assert len(recorder.stored) == 2 and len(recorder.stored[1][1].choices) == 1
    finally:
        bridge.close()


class Stalling:
    """An engine runner whose requests for the jobs named fail as those of an engine killed for stalling do; the
    rest run."""

    def __init__(self, runner, stalled: set[str]) -> None:
        self.runner, self.stalled = runner, stalled

    def submit(self, request, on_tokens=None) -> Future:
        if request.request_id not in self.stalled:
            return self.runner.submit(request, on_tokens)
        future = Future()
        future.set_exception(EngineStalled("stalled with it inside"))
        return future

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def test_a_group_line_whose_engine_stalls_is_handed_back_alone_and_one_whose_hand_back_fails_is_left(
        tiny_model, monkeypatch):
    """In a group of chats run in two phases, a line the engine fails goes back as a stall's, and one whose
    hand-back fails too (the database away) is left to its lease: the other lines are stored all the same."""
    chats = [claimed(JobIn(messages=[{"role": "user", "content": f"Where is parcel {i}?"}], priority=1,
                           sampling={"max_new_tokens": 4})) for i in range(4)]
    stalled, unsettled = str(chats[1].job_id), str(chats[2].job_id)
    bridge = Bridge(Stalling(EngineThread(make_engine(tiny_model)), {stalled, unsettled}), Settings())
    handed_back = []

    def hand_back_stalled(ctx, claimed: Claimed) -> None:
        if str(claimed.job_id) == unsettled:
            raise sa.exc.OperationalError("UPDATE jobs", {}, Exception("the database is away"))
        handed_back.append(str(claimed.job_id))

    monkeypatch.setattr(runs, "hand_back_stalled", hand_back_stalled)
    recorder = Recorder()
    try:
        assert run_together(worker_context(bridge, recorder), chats, alone=False) is False
        assert handed_back == [stalled]
        assert [c.job_id for c, _ in recorder.stored] == [chats[0].job_id, chats[3].job_id]
        assert all(outcome.verdict.ok for _, outcome in recorder.stored)
        assert recorder.pooled == [] and bridge.running() == []
    finally:
        bridge.close()
