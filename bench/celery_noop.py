"""The bare Celery round trip that `bench.pipeline` divides its throughput by.

    python -m celery -A bench.celery_noop worker --pool=threads ...

convoq's own Celery settings (`broker.app.create_celery`: late acks, prefetch 1, the threads pool, the
priority lists) and queues from the environment, with one task that does nothing but count itself in Redis,
so that the bench knows when a burst has gone through. What the service adds on top of this is ours.
"""

from __future__ import annotations

from redis import Redis

from broker.app import create_celery
from jobs.settings import Settings

settings = Settings()
app = create_celery(settings)
redis = Redis.from_url(settings.broker_url.get_secret_value())


@app.task(name="bench.noop")
def noop(counter: str) -> None:
    redis.incr(counter)
