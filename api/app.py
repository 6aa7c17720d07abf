"""The producer API. It writes rows and publishes messages; it never loads a model."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from redis.asyncio import BlockingConnectionPool, Redis
from starlette.exceptions import HTTPException

from api.http.admission import Admission
from api.http.deps import Intake
from api.http.errors import http_error, validation_error
from api.http.gate import Gate
from api.http.ratelimit import RateLimiter
from api.routes import batches, chat, files, health, jobs, metrics, models
from api.service.batch_ingest import Ingests, Needs, OnThreads
from api.service.health import Probe
from api.service.ingest_process import InChildren
from api.service.jobs import statuses
from api.service.metrics import ApiMetrics, WaitCountingPool, broker_client
from api.service.prompt_check import PromptCheck
from api.streams.hub import Hub
from broker.affinity import Router
from broker.app import create_celery
from jobs.settings import Settings, get_settings
from process.heap import freeze_startup_heap
from store.connections import make_db_engine, make_sessions

log = logging.getLogger(__name__)
# pooled database connections, and as many again past them: the threadpool's 40 threads (anyio's default, where
# every route and stream touching the database runs) and the background writers never queue for one
DB_POOL_SIZE = 24
INGESTS = 2  # batches one API process ingests at once


def create_app(settings: Settings | None = None, ingest_in_children: bool = False) -> FastAPI:
    """The app; `ingest_in_children`: batches are ingested in child processes (`api.service.ingest_process`), as
    an API process does, rather than on threads of this one (an app a test builds, many to a process)."""
    settings = settings or get_settings()
    if not settings.known_keys:
        log.warning("CONVOQ_API_KEYS is empty: every /v1 request will be refused")
    check = PromptCheck(settings.model, settings.default_thinking)
    db_engine = make_db_engine(settings.database_url.get_secret_value(), pool_size=DB_POOL_SIZE,
                               pool_class=WaitCountingPool)
    sessions = make_sessions(db_engine)
    # Redis, within `api_redis_connections`: the streams' one pub/sub connection, one for health, one for metrics,
    # the rest Celery's pool for publishing and cancel broadcasts, where each pooled connection is two of Redis's
    # (kombu's channel keeps a client for commands and one for consuming, which it pings when it opens)
    progress = Redis(connection_pool=BlockingConnectionPool.from_url(settings.broker_url.get_secret_value(),
                                                                     max_connections=1))
    hub = Hub(progress, lambda ids: statuses(sessions, ids), settings)
    broker = broker_client(settings)
    celery = create_celery(settings)
    celery.conf.broker_pool_limit = (settings.api_redis_connections - 3) // 2
    api_metrics = ApiMetrics(settings, lambda: {"streams": hub.streams,
                                                        "db_pool_waits": getattr(db_engine.pool, "waits", 0)})
    router = Router(settings)
    runner = (InChildren(settings, INGESTS) if ingest_in_children
              else OnThreads(Needs(sessions, celery, settings, check, router), INGESTS))
    ingests = Ingests(sessions, settings, runner, INGESTS)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(check.load)  # the tokenizer now, not in the first request (or batch) that needs it
        ingests.start()  # it also takes over the ingests that stopped API processes left
        api_metrics.start()
        yield
        await run_in_threadpool(api_metrics.close)
        await run_in_threadpool(ingests.stop)
        await hub.close()
        if broker is not None:
            broker.close()

    app = FastAPI(
        lifespan=lifespan,
        title="convoq",
        version="0.1.0",
        description="Queue-fed batch inference for Qwen3 models. Priority 0..9, 9 is the most urgent.",
    )
    app.state.settings = settings
    app.state.db_engine = db_engine
    app.state.sessions = sessions
    app.state.celery = celery
    app.state.hub = hub
    app.state.broker = broker
    app.state.metrics = api_metrics
    app.state.probe = Probe(sessions, celery, broker)
    app.state.prompt_check = check
    app.state.intake = Intake(settings, sessions, celery, check=check, admission=Admission(settings),
                              ingest=ingests.submit, router=router)
    app.add_middleware(Gate, settings=settings,
                       per_key=RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst),
                       failures=RateLimiter(settings.auth_failures_per_s, settings.auth_failures_burst))
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(batches.router)
    app.include_router(chat.router)
    app.include_router(files.router)
    app.include_router(models.router)
    if not settings.metrics_port:  # else served on a port of its own (`api.service.metrics.ApiMetrics`)
        app.include_router(metrics.router)
    return app


def serving_app() -> FastAPI:
    """The app an API process serves (`convoq api`, in each of its processes): `create_app`, then the heap the
    process's start built frozen (`process.heap`). Tests build theirs with `create_app`, many to a process, and the
    collection before the freeze would take a second there, with torch loaded."""
    app = create_app(ingest_in_children=True)
    freeze_startup_heap()
    return app
