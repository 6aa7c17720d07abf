"""Prefix affinity: a conversation's turns go to the worker that holds its prefix (`broker.affinity`), on a real
PostgreSQL and Redis; workers are played by `workers` rows, and at the end by real processes."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import redis
import sqlalchemy as sa
from sqlalchemy import update

from broker.affinity import BALANCE, Router, consumed_queues, rank
from broker.app import create_celery
from broker.publish import publish
from broker.redis_layout import priority_list
from broker.view import BrokerView
from jobs.queues import home_queue
from jobs.settings import Settings
from jobs.tables import Job, Worker
from tests.service_settings import settings_for
from worker.heartbeat import beat, hand_back
from worker.sweep import Sweeper


def turn(conversation: str | None, tenant: str | None = "acme", priority: int = 9) -> SimpleNamespace:
    """What the router and `publish` read of a job."""
    return SimpleNamespace(id=uuid.uuid4(), conversation_id=conversation, tenant=tenant, priority=priority,
                           kind="chat")


def alive(sessions, *names: str) -> None:
    for name in names:
        beat(sessions, name, {}, 30.0, 15.0)


def ran_on(engine, conversation: str, worker: str, tenant: str = "acme") -> None:
    """A finished turn of `conversation` that `worker` ran."""
    with engine.begin() as conn:
        conn.execute(sa.insert(Job.__table__).values(
            id=uuid.uuid4(), kind="chat", priority=9, payload={}, status="succeeded", conversation_id=conversation,
            tenant=tenant, worker=worker))


def test_new_conversations_spread_within_the_bound_and_later_turns_follow_them(db, database):
    engine, sessions = db
    workers = ["h:1:1", "h:2:1", "h:3:1"]
    alive(sessions, *workers)
    router = Router(settings_for(database))
    first = [turn(f"c{i}") for i in range(24)]
    with sessions() as session:
        homes = router.homes(session, first)
        # another tenant's conversations of the same names, placed by a router of no memory before any turn ran
        alone = Router(settings_for(database)).homes(session, theirs := [turn(f"c{i}", "globex") for i in range(24)])
    load = Counter(homes.values())
    assert set(load) == set(workers) and max(load.values()) <= math.ceil(BALANCE * 24 / 3)

    for job in first:
        ran_on(engine, job.conversation_id, homes[job.id])
    # another process (a router with no memory) sends the second turns where the first ones ran
    with sessions() as session:
        again = Router(settings_for(database)).homes(session, second := [turn(f"c{i}") for i in range(24)])
    assert [again[j.id] for j in second] == [homes[j.id] for j in first]
    # a conversation is its tenant's: another tenant's `c0` ... are conversations of its own, placed as they were
    # before acme's turns ran, never sent after acme's turns (to blocks its requests could not reuse anyway)
    with sessions() as session:
        later = Router(settings_for(database)).homes(session, again := [turn(f"c{i}", "globex") for i in range(24)])
    assert [later[j.id] for j in again] == [alone[j.id] for j in theirs] != [homes[j.id] for j in first]


def test_only_a_gone_workers_conversations_move(db, database):
    engine, sessions = db
    workers = ["h:1:1", "h:2:1", "h:3:1"]
    alive(sessions, *workers)
    for i in range(30):
        ran_on(engine, f"c{i}", workers[i % 3])
    with engine.begin() as conn:
        conn.execute(update(Worker.__table__).where(Worker.name == workers[0]).values(stopped_at=sa.func.now()))
    with sessions() as session:
        homes = Router(settings_for(database)).homes(session, jobs := [turn(f"c{i}") for i in range(30)])
    for i, job in enumerate(jobs):
        if i % 3:
            assert homes[job.id] == workers[i % 3]  # its worker lives: it stays
        else:
            assert homes[job.id] in workers[1:]
    # no worker at all alive: nothing has a home, everything goes to the shared queues
    with engine.begin() as conn:
        conn.execute(update(Worker.__table__).values(heartbeat_at=sa.func.now() - sa.text("interval '1 hour'")))
    with sessions() as session:
        assert Router(settings_for(database)).homes(session, jobs) == {}
    # nor with affinity off, or for jobs without a conversation
    alive(sessions, *workers)
    with sessions() as session:
        assert Router(settings_for(database, affinity=False)).homes(session, jobs) == {}
        assert Router(settings_for(database, "sqla+sqlite:///broker.db")).homes(session, jobs) == {}
        assert Router(settings_for(database)).homes(session, [turn(None)]) == {}


def test_a_joining_worker_takes_only_its_share_of_the_hash_order():
    keys = [f"acme/c{i}" for i in range(3000)]
    three, four = ["a", "b", "c"], ["a", "b", "c", "d"]
    first = {k: max(three, key=lambda w, k=k: rank(k, w)) for k in keys}
    after = {k: max(four, key=lambda w, k=k: rank(k, w)) for k in keys}
    moved = [k for k in keys if first[k] != after[k]]
    assert all(after[k] == "d" for k in moved)  # keys move only to the newcomer
    assert 0.2 < len(moved) / len(keys) < 0.3  # about a quarter of them


def waiting(client: redis.Redis, queue: str) -> list[dict]:
    """The messages waiting in `queue` (every priority), decoded."""
    return [json.loads(raw) for p in range(10) for raw in client.lrange(priority_list(queue, p), 0, -1)]


def test_publish_sends_home_until_the_home_queue_is_full_and_the_sweep_returns_a_gone_workers_queue(
        db, database, broker):
    engine, sessions = db
    settings = settings_for(database, broker, affinity_max_waiting=2)
    alive(sessions, "h:1:1")
    celery = create_celery(settings)
    jobs = [turn("c1") for _ in range(3)] + [turn(None)] + [turn("c1", priority=1)]
    with sessions() as session:
        publish(celery, session, jobs, settings, router=Router(settings))
    client = redis.Redis.from_url(broker)
    home = home_queue(settings.interactive_queue, "h:1:1")
    assert [m["headers"]["id"] for m in waiting(client, home)] == [str(j.id) for j in jobs[:2]][::-1]
    assert {m["headers"]["id"] for m in waiting(client, settings.interactive_queue)} == {str(jobs[2].id),
                                                                                        str(jobs[3].id)}
    assert [m["headers"]["id"] for m in waiting(client, home_queue(settings.bulk_queue, "h:1:1"))] == [str(jobs[4].id)]
    # the sweep's view of the broker counts the home queues' messages as live
    view = BrokerView(settings)
    assert view.live(30.0) == {j.id for j in jobs}

    # the worker stops beating: the next sweep moves its queues' messages to the shared queues, as if sent there
    with engine.begin() as conn:
        conn.execute(update(Worker.__table__).values(heartbeat_at=sa.func.now() - sa.text("interval '1 hour'")))
    swept = Sweeper(sessions, celery, settings).sweep(force=True)
    assert swept["rehomed"] == 3
    assert waiting(client, home) == [] and waiting(client, home_queue(settings.bulk_queue, "h:1:1")) == []
    shared = waiting(client, settings.interactive_queue)
    assert {m["headers"]["id"] for m in shared} == {str(j.id) for j in jobs[:4]}
    assert {m["properties"]["delivery_info"]["routing_key"] for m in shared} == {settings.interactive_queue}
    moved_bulk = waiting(client, settings.bulk_queue)
    assert [(m["headers"]["id"], m["properties"]["priority"]) for m in moved_bulk] == [(str(jobs[4].id), 8)]
    assert view.live(30.0) == {j.id for j in jobs}

    # a worker that stopped cleanly (its row says so at once) while it was still sent turns: the next sweep moves
    # them too
    alive(sessions, "h:2:1")
    with sessions() as session:
        publish(celery, session, late := [turn("c2")], settings, router=Router(settings))
    assert len(waiting(client, home_queue(settings.interactive_queue, "h:2:1"))) == 1
    hand_back(sessions, "h:2:1")
    assert Sweeper(sessions, celery, settings).sweep(force=True)["rehomed"] == 1
    assert str(late[0].id) in {m["headers"]["id"] for m in waiting(client, settings.interactive_queue)}
    view.close()
    client.close()


def test_a_worker_consumes_its_own_queue_of_each_class_first():
    settings = Settings()
    assert consumed_queues(settings, "h:7:9") == [
        "convoq.interactive@h.7.9", "convoq.interactive", "convoq.bulk@h.7.9", "convoq.bulk"]
    assert consumed_queues(settings, "h:7:9", ["convoq.bulk"]) == ["convoq.bulk@h.7.9", "convoq.bulk"]
    assert consumed_queues(settings.model_copy(update={"affinity": False}), "h:7:9") == [
        "convoq.interactive", "convoq.bulk"]
    # a broker whose queues the sweep cannot move: no worker has queues of its own
    assert consumed_queues(Settings(broker_url="sqla+sqlite:///broker.db"), "h:7:9") == [
        "convoq.interactive", "convoq.bulk"]


def test_turns_follow_their_worker_and_a_dead_workers_queue_is_served_by_the_others(service_env, tmp_path):
    from api.http.client import Client
    from cli.stack import Stack
    from jobs.schemas import JobIn
    from tests.api_keys import API_KEY

    env = {**service_env, "CONVOQ_HEARTBEAT_S": "0.5", "CONVOQ_DEAD_AFTER_S": "3", "CONVOQ_SWEEP_EVERY_S": "1",
           "CONVOQ_WORKER_METRICS_PORT": "0"}
    engine = sa.create_engine(service_env["CONVOQ_DATABASE_URL"])

    def worker_of(ids: list[str]) -> list[str]:
        """The worker that ran each job."""
        with engine.connect() as conn:
            ran = dict(conn.execute(sa.select(Job.id, Job.worker).where(Job.id.in_([uuid.UUID(i) for i in ids]))).all())
        return [ran[uuid.UUID(i)] for i in ids]

    with Stack(env, tmp_path / "logs") as stack, Client(stack.api_url, API_KEY) as client:
        stack.start_api()
        stack.start_worker()
        stack.start_worker()
        history = {c: [{"role": "user", "content": f"order {c} never arrived"}] for c in range(8)}

        def turns(sent: Callable[[], None] = lambda: None) -> list[str]:
            ids = [client.submit(JobIn(messages=history[c], priority=9, conversation_id=f"conv-{c}",
                                       sampling={"max_new_tokens": 4})).id for c in history]
            sent()
            for i in ids:
                assert client.wait(i, timeout=120).status == "succeeded"
            for c in history:
                history[c] += [{"role": "assistant", "content": "sorry"}, {"role": "user", "content": "and?"}]
            return [str(i) for i in ids]

        first = worker_of(turns())
        second = worker_of(turns())
        assert second == first  # each conversation stayed on its worker
        assert len(set(first)) == 2  # and the conversations were spread over both

        # one worker dies; the API still counts it alive for a lease, so turns are sent to its own queue
        stack.kill_worker(0)
        dead = next(w for w in first if w.split(":")[1] == str(stack.workers[0].pid))
        broker = redis.Redis.from_url(service_env["CONVOQ_BROKER_URL"])
        stranded: list[int] = []

        def count_stranded() -> None:  # what waits in the dead worker's own queue before any sweep moved it
            stranded.append(len(waiting(broker, home_queue("convoq.interactive", dead))))

        start = time.monotonic()
        third = worker_of(turns(count_stranded))
        broker.close()
        assert stranded[0] > 0  # the dead worker's queue was sent turns: the survivor ran them from there
        assert set(third) == set(first) - {dead} and time.monotonic() - start < 60  # the survivor ran them all
    engine.dispose()
