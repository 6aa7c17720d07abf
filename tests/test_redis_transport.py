"""`broker.redis_transport`: kombu's Redis transport with one client per channel for its plain commands."""

from __future__ import annotations

from kombu import Queue

from broker.app import create_celery
from broker.redis_transport import Channel, Transport
from jobs.settings import Settings


def test_a_channel_keeps_one_client_until_its_pool_is_replaced(broker):
    celery = create_celery(Settings(broker_url=broker))
    with celery.connection() as connection:
        channel = connection.default_channel
        assert isinstance(channel, Channel)
        client = channel._create_client()
        assert channel._create_client() is client  # kombu's own builds a new one for every command
        assert channel._create_client(asynchronous=True) is not client  # the polling clients stay kombu's
        channel._pool = None  # as kombu's `_disconnect_pools` leaves it
        assert channel._create_client() is not client


def test_messages_go_through_it_both_ways(broker):
    celery = create_celery(Settings(broker_url=broker))
    queue = Queue("transport-test")
    with celery.connection() as connection:
        with connection.Producer() as producer:
            for i in range(3):
                producer.publish({"i": i}, routing_key=queue.name, declare=[queue], serializer="json")
        got = []
        with connection.SimpleQueue(queue) as simple:
            for _ in range(3):
                message = simple.get(timeout=5)
                got.append(message.payload["i"])
                message.ack()
    assert sorted(got) == [0, 1, 2]


def test_redis_urls_take_it_and_still_read_as_redis_urls():
    """Flower picks its broker reader (queue lengths, on-call's view) by the URL's scheme."""
    from flower.utils.broker import Broker, Redis

    with create_celery(Settings(broker_url="redis://example:6379/0")).connection() as connection:
        assert isinstance(connection.transport, Transport)
        assert connection.as_uri(include_password=True) == "redis://example:6379/0"
        assert isinstance(Broker(connection.as_uri(include_password=True)), Redis)
    with create_celery(Settings(broker_url="rediss://example:6380/0")).connection() as connection:
        assert not isinstance(connection.transport, Transport)
