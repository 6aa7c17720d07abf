"""`GET /metrics`: queue depth per priority, unacknowledged messages, jobs and batches by status, and this API
process's streams and waits for a database connection.

Everything is read at scrape time (no background thread) and nothing is written (a scrape needs no key): the
Redis lists the way Flower's broker page reads them, over the API's pooled Redis client, and the per-status
counts that triggers keep (`jobs.counts`: a few rows, however many jobs are kept). A source that does not
answer is left out of that scrape, so the other still reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import redis
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import QueuePool
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from api.deps import SessionsDep, SettingsDep
from jobs.broker import UNACKED_KEY, home_lists, queue_lists
from jobs.counts import counts
from jobs.schemas import BatchStatus, JobStatus
from jobs.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(tags=["metrics"])


class WaitCountingPool(QueuePool):
    """A QueuePool that counts the checkouts that found every connection taken (`waits`): requests that
    queued for the database rather than for its answer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waits = 0
        self._waits_lock = threading.Lock()

    def _do_get(self) -> ConnectionPoolEntry:
        # the condition under which QueuePool._do_get blocks on its queue
        if self.checkedin() == 0 and -1 < self._max_overflow <= self.overflow():
            with self._waits_lock:
                self.waits += 1
        return super()._do_get()


def broker_client(settings: Settings) -> redis.Redis | None:
    """A Redis client over one connection, kept open and taken in turn (health checks and scrapes are brief),
    for a Redis broker; None for another kombu transport."""
    url = settings.broker_url.get_secret_value()
    if not url.startswith(("redis://", "rediss://")):
        return None
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=1, timeout=2, socket_timeout=2,
                                                 socket_connect_timeout=2)
    return redis.Redis(connection_pool=pool)


class ServiceCollector(Collector):
    """`broker`: as `broker_client` makes it (None: no Redis lists to count); `process`: this API process's
    own figures (streams open, waits for a pooled database connection), left out when None."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], broker: redis.Redis | None,
                 process: Callable[[], dict[str, int]] | None = None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.broker = broker
        self.process = process

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._database()
        if self.process is not None:
            figures = self.process()
            yield GaugeMetricFamily("convoq_api_streams", "Event streams and waiting chats open in this API process",
                                    value=figures["streams"])
            yield CounterMetricFamily("convoq_api_db_pool_waits", "Database connections this API process had to "
                                      "wait for, every pooled one being in use", value=figures["db_pool_waits"])

    def _broker(self) -> list[Metric]:
        if self.broker is None:
            return []  # another kombu transport: there are no Redis lists to count
        try:
            return self._read_broker(self.broker)
        except redis.RedisError as exc:
            log.warning("metrics: broker unreachable (%s); queue depth left out", exc)
            return []

    def _read_broker(self, client: redis.Redis) -> list[Metric]:
        lists, homes = queue_lists(self.settings), home_lists(client, self.settings)
        pipe = client.pipeline(transaction=False)
        for names in [*lists.values(), *homes.values()]:
            for name in names:
                pipe.llen(name)
        pipe.hlen(UNACKED_KEY)
        *lengths, unacked = pipe.execute()
        depth = GaugeMetricFamily("convoq_queue_messages", "Messages waiting in the broker, by queue and job "
                                  "priority (9 is the most urgent)", labels=["queue", "priority"])
        counts = iter(lengths)
        for queue, names in lists.items():
            for priority in range(len(names)):
                depth.add_metric([queue, str(priority)], next(counts))
        home = GaugeMetricFamily("convoq_home_queue_messages", "Messages waiting in the workers' own queues "
                                 "(`jobs.affinity`), by the shared queue of their class", labels=["queue"])
        for queue, names in homes.items():
            home.add_metric([queue], sum(next(counts) for _ in names))
        return [depth, home, GaugeMetricFamily("convoq_broker_unacked_messages",
                                         "Messages delivered to a worker and not yet acknowledged", value=unacked)]

    def _database(self) -> list[Metric]:
        try:
            with self.sessions() as session:
                by_table = counts(session)
        except SQLAlchemyError as exc:
            log.warning("metrics: database unreachable (%s); job counts left out", type(exc).__name__)
            return []
        return [
            by_status("convoq_jobs", "Jobs by status", by_table["jobs"], JobStatus),
            by_status("convoq_batches", "Batches by status", by_table["batches"], BatchStatus),
        ]


def by_status(name: str, documentation: str, counts: dict[str, int], statuses: type) -> GaugeMetricFamily:
    """Every known status is reported, zero included, so a status that empties does not vanish."""
    family = GaugeMetricFamily(name, documentation, labels=["status"])
    for status in statuses:
        family.add_metric([status.value], counts.get(status.value, 0))
    return family


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request, settings: SettingsDep, sessions: SessionsDep) -> Response:
    state = request.app.state
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_cpu_seconds_total and memory: this API process's share of a job
    registry.register(ServiceCollector(settings, sessions, state.broker, lambda: {
        "streams": state.hub.streams, "db_pool_waits": getattr(state.db_engine.pool, "waits", 0)}))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
