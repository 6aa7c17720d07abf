"""An API process's ingests, run in child processes of its own (`batch_ingest.Runner`).

A batch's lines are CPU work from the first to the last (JSON, validation, the template, the rows): on a thread
of the API process they held the interpreter's lock, and every request the process served meanwhile waited
behind them at each of its turns (a chat took seconds instead of a tenth of one). In a child, the lines share
the machine's cores through the kernel's scheduler, and at a lower priority (`NICE`) than the processes that
answer requests, so that a chat's work comes first and the ingest takes the time left over.

A child is spawned (never forked: the parent's threads and connections are not a child's) as the API starts,
so that the first batch does not wait seconds for its imports and its tokenizer; it builds what an ingest needs once (its own database pool, Celery app and prompt check), and then takes batch
after batch; the parent keeps the leases and renews them. A child exits when its parent is gone, as a child of
a killed API process must: another process takes the batch over once the lease lapses, and the fenced writes of
an orphan that went on would change nothing.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from api.service.batch_ingest import Needs, run_ingest
from api.service.prompt_check import PromptCheck
from broker.affinity import Router
from broker.app import create_celery
from jobs.settings import Settings
from store.connections import make_db_engine, make_sessions

log = logging.getLogger(__name__)

NICE = 10  # how much lower than the API's a child's priority is: a tenth of a core's share when both want one
POOL_SIZE = 2  # database connections a child holds: its ingest's, and the one its publish reads from
PARENT_CHECK_S = 1.0  # how often a child looks for its parent

_needs: Needs | None = None  # a child's, built once by `_start` (a process pool calls its jobs with no state)


class InChildren:
    """Up to `processes` ingests at once, each in a child process (spawned now, ready before the first ingest)."""

    def __init__(self, settings: Settings, processes: int) -> None:
        self.settings, self.processes = settings, processes
        self._pool = self._new_pool()
        self._lock = threading.Lock()

    def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start, initargs=(self.settings, os.getpid()))
        for _ in range(self.processes):  # a pool spawns a child per job waiting, so these start every child now
            pool.submit(_ready)
        return pool

    def submit(self, batch_id: uuid.UUID, lease: uuid.UUID) -> Future:
        with self._lock:
            try:
                return self._pool.submit(_run, batch_id, lease)
            except BrokenProcessPool:  # a child died (killed, out of memory): its batch's lease lapses
                log.warning("an ingest process died; starting new ones")
                self._pool = self._new_pool()
                return self._pool.submit(_run, batch_id, lease)

    def shutdown(self) -> None:
        with self._lock:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _start(settings: Settings, parent: int) -> None:
    """A child's start: a lower priority, what its ingests need, and a watch on its parent."""
    global _needs
    os.nice(NICE)
    # a stop sent to the API's process group is the parent's to handle: it lets the ingest under way finish
    # (`Ingests.stop`), as it did on a thread of its own, then ends its children
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check = PromptCheck(settings.model, settings.default_thinking)
    check.load()
    sessions = make_sessions(make_db_engine(settings.database_url.get_secret_value(), pool_size=POOL_SIZE))
    _needs = Needs(sessions, create_celery(settings), settings, check, Router(settings))
    threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(PARENT_CHECK_S)
    os._exit(0)


def _ready() -> None:
    """Nothing: a child's start (`_start`) is what was wanted."""


def _run(batch_id: uuid.UUID, lease: uuid.UUID) -> None:
    assert _needs is not None, "a child's start builds what it needs"
    run_ingest(_needs, batch_id, lease)
