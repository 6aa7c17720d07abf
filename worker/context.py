"""What a worker process holds for its whole life (`WorkerContext`): the database, the engine, the reconciler,
the metrics and the writers that batch claims and stores. Made when the worker starts, closed when it stops.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from broker.affinity import Advert, Router
from broker.view import BrokerView
from engine.interface import EngineDead, EngineStalled
from jobs.queues import home_tag
from jobs.settings import Settings
from store.connections import make_db_engine, make_sessions
from worker import results
from worker.bridge import Bridge
from worker.claims import claim_many
from worker.database import retrying
from worker.engine_factory import start_engine
from worker.fence import Claimed
from worker.group_commit import GroupCommit
from worker.heartbeat import hand_back, mark_draining
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.outcome import Outcome
from worker.progress import ProgressPublisher
from worker.reconciler import Reconciler
from worker.shutdown import Shutdown
from worker.solo import Solo
from worker.usage import cpu_seconds

log = logging.getLogger(__name__)
# A worker frozen between the statements of a transaction (SIGSTOP, a paused VM) holds that transaction's locks:
# its `workers` row and its jobs' rows, after a heartbeat's first statement. The server ends such a session after
# this long, as it ends the sweep's lock (`worker.sweep.LOCK_IDLE_S`), so the sweep hands the frozen worker's jobs
# back. A working worker never sits that long inside a transaction, and its writes retry a dropped connection.
FROZEN_TRANSACTION_S = 60.0


@dataclass
class WorkerContext:
    """What one worker process holds for its whole life: the database, the engine, the reconciler."""

    settings: Settings
    celery: Celery
    sessions: sessionmaker[Session]
    router: Router  # where the jobs it sends again go (`broker.affinity`)
    bridge: Bridge
    reconciler: Reconciler
    name: str
    metrics: WorkerMetrics
    progress: ProgressPublisher
    leases: Leases  # the jobs this process holds, renewed at each heartbeat
    solo: Solo  # suspects run with the engine to themselves
    claim: GroupCommit[str, Claimed | None]  # job id -> the claimed job, or None if it is not queued
    store: GroupCommit[tuple[Claimed, Outcome], results.Stored]
    shutdown: Shutdown  # the grace of a warm shutdown, then its hand-back
    lines: ThreadPoolExecutor  # a grouped message's lines that are not single-answer chats run side by side here

    @classmethod
    def start(cls, settings: Settings, celery: Celery, name: str, advert: Advert,
              on_stall: Callable[[EngineStalled], None] | None = None) -> WorkerContext:
        """Start a worker's context. `name` is this worker's row in `workers` (`worker_name`), with its `advert`.
        `on_stall` is what to do when an engine thread stalls (an engine process is restarted instead). What was
        built is closed again if a later part fails. That matters most for the engine process, which would keep
        this process from exiting."""
        with ExitStack() as built:
            # every write here retries on a dropped connection (`database.retrying`), so no ping per checkout
            db = make_db_engine(settings.database_url.get_secret_value(),
                                pool_size=min(settings.worker_concurrency, 32), ping_idle_s=None,
                                idle_in_transaction_s=FROZEN_TRANSACTION_S)
            built.callback(db.dispose)
            sessions = make_sessions(db)
            shutdown = Shutdown(settings.shutdown_grace_s)  # before the engine, whose death in a shutdown is no crash
            bridge = Bridge.for_settings(start_engine(settings, on_death=partial(engine_died, shutdown=shutdown),
                                                      on_stall=on_stall), settings)
            built.callback(bridge.close)
            leases = Leases()
            router = Router(settings)
            metrics = WorkerMetrics.start(settings.worker_metrics_port, bridge.stats, settings.metrics_refresh_s)
            reconciler = Reconciler(sessions, celery, settings, name, leases, bridge.stop,
                                    lambda: (cpu_seconds(bridge.engine_pid), metrics.finished_total()),
                                    advert).start()  # its first beat reaches the database, or raises
            built.pop_all()
        shutdown.start(lambda reason: bridge.stop(bridge.running(), reason), partial(drain, settings, sessions, name))
        progress = ProgressPublisher(settings.broker_url.get_secret_value(), bridge.tokenizer)
        claim = GroupCommit(lambda ids: claim_many(sessions, ids, name, settings.max_attempts,
                                                           settings.dead_after_s), "claims")
        store = GroupCommit(lambda done: results.store_many(sessions, done, worker=name), "stores")
        # the bulk gate holds the lines in flight to its share of `worker_concurrency` (give or take a group)
        lines = ThreadPoolExecutor(settings.worker_concurrency, thread_name_prefix="line")
        return cls(settings, celery, sessions, router, bridge, reconciler, name, metrics, progress, leases, Solo(),
                   claim, store, shutdown, lines)

    def close(self) -> int:
        """Hand back the jobs this worker still holds, then close the engine and the rest; returns how many went
        back. The engine goes last, because a task it outlived would see its end as a crash and exit the worker,
        leaving its job to expire and be charged."""
        self.shutdown.begin(cold=True)  # whatever still runs stops now, and an engine gone from here is no crash
        self.reconciler.stop()
        usage = self.reconciler.usage() if self.reconciler.usage is not None else None  # the jobs since its last beat
        try:
            return retrying(lambda: hand_back(self.sessions, self.name, usage), "hand back at shutdown",
                                    deadline_s=10.0)
        finally:  # a hand-back that failed is the sweep's to finish (leases); the rest closes all the same
            rehome_own(self.settings, self.name)
            self.bridge.close()
            self.lines.shutdown(wait=False)
            self.claim.close()
            self.store.close()
            self.progress.close()


def engine_died(error: EngineDead, shutdown: Shutdown | None = None) -> None:
    """The model's state is unknown, so exit and let the supervisor restart the worker. This worker's leases
    then expire and the reconciler hands its jobs back. During a shutdown the worker is leaving anyway. Its tasks
    hand their jobs back uncharged (`hand_back_at_shutdown`) and it exits as it was going to."""
    if shutdown is not None and shutdown.begun.is_set():
        log.warning("the engine ended during shutdown (%s); its jobs go back to the queue", error)
        return
    log.critical("the engine is dead (%s); exiting", error)
    os._exit(3)


def drain(settings: Settings, sessions: sessionmaker[Session], name: str) -> None:
    """Called as this worker's shutdown begins. Its row says it is draining, so the router sends it nothing
    more, and what already waits in its own queues goes to the shared ones now, not once the grace is spent."""
    try:
        mark_draining(sessions, name)
    finally:
        rehome_own(settings, name)


def rehome_own(settings: Settings, name: str) -> None:
    """At shutdown, what still waits in this worker's own queues goes to the shared ones. The next worker
    takes it there now, rather than after the sweep has seen this worker gone."""
    broker = BrokerView(settings)
    try:
        if moved := broker.rehome(lambda _queue, tag: tag == home_tag(name)):
            log.info("moved %d messages from this worker's own queues to the shared queues", moved)
    except Exception:  # the broker is away, so the sweep moves them once it sees this worker gone
        log.exception("could not move this worker's own queues' messages to the shared queues")
    finally:
        broker.close()
