"""kombu's Redis transport, with one client per channel for its plain commands.

kombu builds a new `redis.Redis` object for every publish, event and acknowledgement on a channel (the
connection comes from the channel's pool either way). Building one fills its table of response callbacks, a
couple of hundred entries: about a tenth of a worker's CPU per job, and a twentieth of the API's, went there.
A `redis.Redis` over a connection pool is safe to share between threads (each command takes a connection from
the pool), so a channel keeps one, made again if the channel's pool is replaced.
"""

from __future__ import annotations

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

SCHEME = "redis"  # the broker URL scheme this transport stands in for (`rediss` and sentinel keep kombu's own)


class Channel(kombu_redis.Channel):
    _shared: redis.Redis | None = None

    def _create_client(self, asynchronous: bool = False) -> redis.Redis:
        if asynchronous:  # the polling clients (BRPOP, pub/sub) are kept by kombu itself
            return super()._create_client(asynchronous=True)
        pool = self.pool
        if self._shared is None or self._shared.connection_pool is not pool:
            self._shared = super()._create_client()
        return self._shared


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Make `redis://` broker URLs take this transport in this process. kombu finds a URL's transport by its
    scheme in its alias table; replacing the alias, rather than naming the class in Celery's `broker_transport`,
    keeps every connection's URL a plain `redis://` one: Flower picks its queue-length reader by that scheme, and
    the worker's banner shows it."""
    TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"
