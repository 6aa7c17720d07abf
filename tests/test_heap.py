"""A long-lived process freezes the heap its start built, so that the collector's full collections do not walk
it again and again (`process.heap`): the worker once it is ready to consume, an API process once its app is built."""

from __future__ import annotations

import gc

import pytest
from celery.signals import worker_ready
from fastapi.testclient import TestClient

from api.app import create_app, serving_app
from broker.app import create_celery
from jobs.settings import Settings
from process.heap import freeze_startup_heap
from worker.tasks import worker_app


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class Consumer:
    """What sends `worker_ready`: a worker's consumer, which knows its app."""

    def __init__(self, app) -> None:
        self.app = app


def tracked(obj: object) -> bool:
    """Whether the collector's generations hold `obj` (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_what_lives_at_the_freeze_leaves_the_collectors_walks_and_later_garbage_is_still_collected():
    started = []
    started.append(started)  # a cycle: only the collector could ever free it
    assert tracked(started)
    assert freeze_startup_heap() > 0
    assert not tracked(started)
    later = []
    later.append(later)
    assert tracked(later)  # allocated after the freeze: collected as ever
    del later
    assert gc.collect() >= 1


def test_a_worker_freezes_its_heap_once_it_is_ready_and_only_for_its_own_app(database, broker, tiny_model):
    settings = Settings(database_url=database, broker_url=broker, model=str(tiny_model))
    celery = worker_app(settings, "heap-test-worker")
    worker_ready.send(sender=Consumer(create_celery(settings)))  # another app's worker in this process
    assert gc.get_freeze_count() == 0
    worker_ready.send(sender=Consumer(celery))
    assert gc.get_freeze_count() > 0


def test_an_api_process_freezes_its_heap_once_its_app_is_built(database, broker, tiny_model, monkeypatch):
    for name, value in {"CONVOQ_DATABASE_URL": database, "CONVOQ_BROKER_URL": broker, "CONVOQ_MODEL": str(tiny_model),
                        "CONVOQ_API_KEYS": "k" * 16}.items():
        monkeypatch.setenv(name, value)
    create_app()  # what tests build: nothing frozen
    assert gc.get_freeze_count() == 0
    served = serving_app()  # what `convoq api` serves (settings from the environment)
    assert gc.get_freeze_count() > 0
    with TestClient(served) as client:
        assert client.get("/healthz").status_code < 500
