"""`GET /metrics`: queue depth per priority, unacknowledged messages, jobs and batches by status.

Everything is read at scrape time (no background thread): the Redis lists the way Flower's broker page
reads them, and the per-status counts that triggers keep (`jobs.counts`: a few rows, however many jobs are
kept). A source that does not answer is left out of that scrape, so the other still reports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis
from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from api.deps import SessionsDep, SettingsDep
from jobs.broker import UNACKED_KEY, queue_lists
from jobs.counts import counts
from jobs.schemas import BatchStatus, JobStatus
from jobs.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(tags=["metrics"])

class ServiceCollector(Collector):
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings = settings
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        yield from self._broker()
        yield from self._database()

    def _broker(self) -> list[Metric]:
        if not self.settings.broker_url.get_secret_value().startswith(("redis://", "rediss://")):
            return []  # another kombu transport: there are no Redis lists to count
        try:
            return self._read_broker()
        except redis.RedisError as exc:
            log.warning("metrics: broker unreachable (%s); queue depth left out", exc)
            return []

    def _read_broker(self) -> list[Metric]:
        lists = queue_lists(self.settings)
        client = redis.Redis.from_url(self.settings.broker_url.get_secret_value(), socket_timeout=2, socket_connect_timeout=2)
        try:
            pipe = client.pipeline(transaction=False)
            for names in lists.values():
                for name in names:
                    pipe.llen(name)
            pipe.hlen(UNACKED_KEY)
            *lengths, unacked = pipe.execute()
        finally:
            client.close()
        depth = GaugeMetricFamily("convoq_queue_messages", "Messages waiting in the broker, by queue and job "
                                  "priority (9 is the most urgent)", labels=["queue", "priority"])
        counts = iter(lengths)
        for queue, names in lists.items():
            for priority in range(len(names)):
                depth.add_metric([queue, str(priority)], next(counts))
        return [depth, GaugeMetricFamily("convoq_broker_unacked_messages",
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
def metrics(settings: SettingsDep, sessions: SessionsDep) -> Response:
    registry = CollectorRegistry()
    registry.register(ServiceCollector(settings, sessions))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
