"""What `GET /metrics` answers (`api.routes.metrics`): queue depth per priority, unacknowledged messages, jobs and
batches by status, and this API process's streams and waits for a database connection.

The figures are collected by one thread of the API process at most every `CONVOQ_METRICS_REFRESH_S`
(`process.scrape.Snapshot`; only the process's own counts, in its memory, are read at each scrape), on a Redis
connection and a database connection of its own, not the health probe's:
a scrape answers the last ones without a command to either, so a flood of scrapes costs neither Redis, nor the
database, nor `/healthz`. Nothing is written: the Redis lists are read the way Flower's broker page reads them,
and the per-status counts that triggers keep (`store.counts`: a few rows, however many jobs are kept). A source
that does not answer is left out of that round, so the other still reports.

With `CONVOQ_METRICS_KEY` a scrape must send it (`Authorization: Bearer KEY`); with `CONVOQ_METRICS_PORT` the
figures are served on that port (for a scraper inside the cluster), not on the API's own.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import QueuePool
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from broker.redis_layout import UNACKED_KEY, home_lists, is_redis, queue_lists
from jobs.priority import HIGHEST, LEVELS
from jobs.settings import Settings, hash_key
from jobs.status import BatchStatus, JobStatus
from process.scrape import Snapshot, serve
from store.connections import make_db_engine, make_sessions
from store.counts import counts

log = logging.getLogger(__name__)


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
    """A Redis client over one connection, kept open and taken in turn (its calls are brief), for a Redis broker;
    None for another kombu transport. The health probe has one, the metrics' thread another."""
    if not is_redis(settings):
        return None
    pool = redis.BlockingConnectionPool.from_url(settings.broker_url.get_secret_value(), max_connections=1,
                                                 timeout=2, socket_timeout=2, socket_connect_timeout=2)
    return redis.Redis(connection_pool=pool)


class ProcessFigures(Collector):
    """This API process's own figures, counts in its memory, read at each scrape: streams open, and waits for a
    pooled database connection (`process` gives both)."""

    def __init__(self, process: Callable[[], dict[str, int]]) -> None:
        self.process = process

    def collect(self) -> Iterator[Metric]:
        figures = self.process()
        yield GaugeMetricFamily("convoq_api_streams", "Event streams and waiting chats open in this API process",
                                value=figures["streams"])
        yield CounterMetricFamily("convoq_api_db_pool_waits", "Database connections this API process had to "
                                  "wait for, every pooled one being in use", value=figures["db_pool_waits"])


class ServiceCollector(Collector):
    """`broker`: as `broker_client` makes it (None: no Redis lists to count)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], broker: redis.Redis | None) -> None:
        self.settings = settings
        self.sessions = sessions
        self.broker = broker

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._database()

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
                                  f"priority ({HIGHEST} is the most urgent)", labels=["queue", "priority"])
        counts = iter(lengths)
        for queue in lists:
            for priority in LEVELS:
                depth.add_metric([queue, str(priority)], next(counts))
        home = GaugeMetricFamily("convoq_home_queue_messages", "Messages waiting in the workers' own queues "
                                 "(`broker.affinity`), by the shared queue of their class", labels=["queue"])
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


class ApiMetrics:
    """What this API process's scrapes read (`registry`): its CPU and memory (process_cpu_seconds_total: its
    share of a job) and `ServiceCollector`'s figures, collected by one thread (`start`) on a database connection
    and a Redis connection of their own; and the counts `process` gives, read at each scrape."""

    def __init__(self, settings: Settings, process: Callable[[], dict[str, int]]) -> None:
        self.settings = settings
        # one thread uses it: one connection; a dropped one fails that round, and the next connects again
        self.db_engine = make_db_engine(settings.database_url.get_secret_value(), pool_size=1, ping_idle_s=None)
        self.broker = broker_client(settings)
        service = ServiceCollector(settings, make_sessions(self.db_engine), self.broker)
        self.snapshot = Snapshot([ProcessCollector(registry=None), service], settings.metrics_refresh_s)
        self.registry = CollectorRegistry()
        self.registry.register(self.snapshot)
        self.registry.register(ProcessFigures(process))
        key = settings.metrics_key.get_secret_value()
        self._key_digest = hash_key(key) if key else None
        self._server = None

    def start(self) -> None:
        self.snapshot.start()
        if self.settings.metrics_port:
            served = serve(self.registry, self.settings.metrics_port, "API")
            self._server = None if served is None else served[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.snapshot.close()
        self.db_engine.dispose()
        if self.broker is not None:
            self.broker.close()

    def allows(self, authorization: str | None) -> bool:
        """Whether a scrape with this `Authorization` header may read: any, without a metrics key; else the key,
        compared in constant time."""
        if self._key_digest is None:
            return True
        scheme, _, offered = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hash_key(offered.strip()), self._key_digest)
