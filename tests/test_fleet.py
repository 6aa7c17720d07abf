"""A fleet of workers that nothing black-holes: a worker that cannot start consumes nothing, a conversation is
routed only to a worker that reads its class, a draining worker gets nothing new and hands its own queues on at
once, SIGQUIT hands the jobs back and exits, and a worker leaves no exchange bindings in Redis."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import update

from api.http.client import Client
from broker.affinity import Advert, Router, by_name, consumed_queues, own_queues
from broker.app import create_celery
from broker.publish import publish
from broker.redis_layout import priority_list
from cli.stack import Stack
from jobs.queues import home_queue
from jobs.schemas import JobIn
from jobs.tables import Job, Worker
from tests.api_keys import API_KEY
from tests.service_settings import settings_for
from tests.test_deploys import PACED, charged, messages
from tests.test_faults import wait_for
from worker.exits import NOT_STARTED
from worker.heartbeat import beat, mark_draining
from worker.shutdown import Shutdown
from worker.sweep import Sweeper

INTERACTIVE, BULK = "convoq.interactive", "convoq.bulk"


def turn(conversation: str, priority: int = 9) -> SimpleNamespace:
    """What the router and `publish` read of a job."""
    return SimpleNamespace(id=uuid.uuid4(), conversation_id=conversation, tenant="acme", priority=priority,
                           kind="chat")


def ran_on(engine, conversation: str, worker: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.insert(Job.__table__).values(
            id=uuid.uuid4(), kind="summarize", priority=2, payload={}, status="succeeded",
            conversation_id=conversation, tenant="acme", worker=worker))


def test_a_conversation_goes_only_to_a_worker_that_reads_its_class_takes_conversations_and_is_not_draining(
        db, database):
    engine, sessions = db
    settings = settings_for(database)
    adverts = {"h:bulk:1": Advert.of(settings, [BULK]), "h:chat:1": Advert.of(settings, [INTERACTIVE]),
               "h:off:1": Advert.of(settings.model_copy(update={"affinity": False}), None)}
    for name, advert in adverts.items():
        beat(sessions, name, {}, 30.0, 15.0, advert=advert)
    assert adverts["h:bulk:1"].columns() == {"classes": "bulk", "affinity": True}
    # a summary ran on the bulk-only worker: the conversation's next chat turn must go where chats are read
    for i in range(20):
        ran_on(engine, f"c{i}", "h:bulk:1")
    chats, summaries = [turn(f"c{i}") for i in range(20)], [turn(f"c{i}", priority=2) for i in range(20)]
    with sessions() as session:
        homes = Router(settings).homes(session, chats + summaries)
    assert {homes[j.id] for j in chats} == {"h:chat:1"}
    assert {homes[j.id] for j in summaries} == {"h:bulk:1"}

    # draining: from the moment its shutdown begins, the chat worker is given nothing; with no other worker
    # reading chats, they go to the shared queue
    mark_draining(sessions, "h:chat:1")
    beat(sessions, "h:chat:1", {}, 30.0, 15.0, advert=adverts["h:chat:1"])  # its beats go on while it drains
    with sessions() as session:
        homes = Router(settings).homes(session, chats + summaries)
    assert set(homes) == {j.id for j in summaries}


def test_the_sweep_moves_own_queues_nobody_reads_keeping_their_order(db, database, broker):
    engine, sessions = db
    settings = settings_for(database, broker)
    beat(sessions, "h:1:1", {}, 30.0, 15.0, advert=Advert.of(settings, None))
    celery = create_celery(settings)
    client = redis.Redis.from_url(broker)
    earlier = turn("other")
    with sessions() as session:
        publish(celery, session, [earlier], settings)  # already waiting in the shared queue
        sent = [turn("c1") for _ in range(5)]
        for job in sent:  # one at a time, as the turns of a conversation come
            publish(celery, session, [job], settings, router=Router(settings))
    assert client.llen(priority_list(home_queue(INTERACTIVE, "h:1:1"), 9)) == 5
    # a worker that advertised bulk only (an old router sent chats to it regardless): its chat queue is moved
    with engine.begin() as conn:
        conn.execute(update(Worker.__table__).values(classes="bulk"))
    assert Sweeper(sessions, celery, settings).sweep(force=True)["rehomed"] == 5
    served = []
    while (raw := client.rpop(priority_list(INTERACTIVE, 9))) is not None:  # as a consumer takes them
        served.append(json.loads(raw)["headers"]["id"])
    # in the order they were sent, and still served before what waited in the shared queue
    assert served == [str(j.id) for j in sent] + [str(earlier.id)]
    client.close()


def test_own_queues_follow_the_classes_consumed_and_leave_no_exchange_bindings(db, database, broker):
    _, sessions = db
    settings = settings_for(database, broker)
    assert own_queues(settings, "h:7:9", [BULK]) == ["convoq.bulk@h.7.9"]
    assert consumed_queues(settings, "h:7:9", [BULK]) == ["convoq.bulk@h.7.9", BULK]
    celery = create_celery(settings)
    client = redis.Redis.from_url(broker)
    beat(sessions, "h:7:9", {}, 30.0, 15.0, advert=Advert.of(settings, None))
    with celery.connection_for_write() as conn:
        for name in own_queues(settings, "h:7:9"):  # what a worker declares as it starts consuming
            by_name(name)(conn.default_channel).declare()
    with sessions() as session:  # and a publish to its own queue, which declares it too
        publish(celery, session, [job := turn("c1")], settings, router=Router(settings))
    assert client.llen(priority_list(home_queue(INTERACTIVE, "h:7:9"), 9)) == 1
    assert list(client.scan_iter("_kombu.binding.*@*")) == []
    # a message restored from the own queue goes back there (its delivery info names the queue itself)
    raw = json.loads(client.rpop(priority_list(home_queue(INTERACTIVE, "h:7:9"), 9)))
    assert raw["headers"]["id"] == str(job.id)
    assert raw["properties"]["delivery_info"]["routing_key"] == home_queue(INTERACTIVE, "h:7:9")
    client.close()


def test_a_shutdown_drains_as_soon_as_it_begins_not_once_its_grace_is_spent():
    shutdown, drained, stopped = Shutdown(grace_s=30.0), threading.Event(), []
    shutdown.start(stopped.append, drained.set)
    shutdown.begin()
    assert drained.wait(5) and not shutdown.over.is_set() and stopped == []
    # a cold one stops the runs first, then drains
    cold, order = Shutdown(grace_s=30.0), []
    done = threading.Event()
    cold.start(lambda reason: order.append(reason), lambda: (order.append("drained"), done.set()))
    cold.begin(cold=True)
    assert done.wait(5) and order == ["shutdown", "drained"]


def broken_copy(model, tmp_path):
    """The model's folder with its weights cut short, as a failed download or a bad image leaves it."""
    broken = shutil.copytree(model, tmp_path / "broken-model")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return broken


def test_a_worker_whose_model_cannot_load_exits_before_it_consumes_anything(service_env, tiny_model, tmp_path):
    env = {**service_env, "CONVOQ_MODEL": str(broken_copy(tiny_model, tmp_path)), "CONVOQ_WORKER_METRICS_PORT": "0"}
    with Stack({**service_env, "CONVOQ_WORKER_METRICS_PORT": "0"}, tmp_path / "logs") as stack, \
            Client(stack.api_url, API_KEY) as client:
        stack.start_api()
        ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Order {i}?"}], priority=9,
                                   sampling={"max_new_tokens": 4})).id for i in range(5)]
        stack.env.update(env)
        with pytest.raises(RuntimeError, match=rf"worker exited \({NOT_STARTED}\)"):
            stack.start_worker(timeout=180)
        assert set(messages(service_env["CONVOQ_BROKER_URL"], ids).values()) == {1}  # every message still there
        assert charged(service_env["CONVOQ_DATABASE_URL"], ids) == {"jobs": [("queued", 0, 0, 5)], "runs": {}}


def test_sigquit_hands_the_jobs_back_at_once_and_exits(service_env, database, broker, tmp_path):
    env = {**service_env, **PACED, "CONVOQ_SHUTDOWN_GRACE_S": "60", "CONVOQ_WORKER_METRICS_PORT": "0"}
    with Stack(env, tmp_path / "logs") as stack, Client(stack.api_url, API_KEY) as client:
        stack.start_api()
        ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Order {i}?"}], priority=8,
                                   conversation_id=f"c{i}", sampling={"max_new_tokens": 400})).id
               for i in range(6)]
        worker = stack.start_worker()
        wait_for(database, lambda c: c.get("running", 0) == 4, 60, "four running")
        started = time.monotonic()
        os.kill(worker.pid, signal.SIGQUIT)
        assert worker.wait(45) == 0 and time.monotonic() - started < 30  # no grace, and no wait on the engine
        assert charged(database, ids) == {"jobs": [("queued", 0, 0, 6)], "runs": {"returned": 4}}
        # each job's message back in a shared queue, none left in the gone worker's own queues
        assert set(messages(broker, ids).values()) == {1}
        client_redis = redis.Redis.from_url(broker)
        assert list(client_redis.scan_iter("convoq.*@*")) == []
        client_redis.close()
        with sa.create_engine(database).connect() as conn:
            assert conn.execute(sa.select(Worker.draining_at.is_not(None), Worker.stopped_at.is_not(None))).all() \
                == [(True, True)]
