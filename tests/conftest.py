"""Shared fixtures: tiny Qwen3 checkpoints, throwaway Redis and PostgreSQL, the service as real processes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cli.tiny_model import build_tiny_model, write_fp8
from tests.api_keys import API_KEY


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Checkpoint folders by preset name: `tiny` (tied), `tiny-untied` (untied, GQA 1), `tiny-swa` (windows),
    `tiny-moe` (Qwen3-MoE)."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_model(root / name, preset=name)
            for name in ("tiny", "tiny-untied", "tiny-swa", "tiny-moe")}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["tiny"]


@pytest.fixture(scope="session")
def fp8_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """By preset (`tiny-blocks`: whole 128-blocks, head_dim 128; `tiny-blocks-ragged`: 64-row K/V shards, an
    MLP of 4.5 blocks): an FP8 checkpoint laid out as Qwen's `*-FP8`, and its weights dequantized to an
    ordinary float32 checkpoint."""
    root = tmp_path_factory.mktemp("fp8")
    return {name: write_fp8(build_tiny_model(root / name, preset=name), root / f"{name}-fp8", root / f"{name}-fp32")
            for name in ("tiny-blocks", "tiny-blocks-ragged")}


@pytest.fixture(scope="session")
def fp8_moe_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Qwen3-MoE laid out as Qwen's `*-FP8` (`tiny-moe-blocks`: experts of two whole 128-blocks, head_dim 128;
    `ragged`: experts of 1.5 blocks, each expert's up projection starting mid-block), and each dequantized to an
    ordinary float32 checkpoint."""
    root = tmp_path_factory.mktemp("fp8-moe")
    widths = {"whole": 256, "ragged": 192}
    return {name: write_fp8(build_tiny_model(root / name, preset="tiny-moe-blocks", moe_intermediate_size=width),
                            root / f"{name}-fp8", root / f"{name}-fp32") for name, width in widths.items()}


QWEN3_TOKENIZER = Path(__file__).parent / "data" / "qwen3-tokenizer"


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory) -> Path:
    """Small random weights around the real Qwen3 tokenizer, chat template and generation config: renders,
    tokenizes and samples by default like a downloaded `Qwen/Qwen3-*` folder."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3-small", preset="qwen3-small",
                            tokenizer=QWEN3_TOKENIZER)


# --- torch in this process -----------------------------------------------------------------------------------
# Engine and kernel tests ask for these by name, with `pytest.mark.usefixtures`.


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One intra-op thread for these small models: with two threads on two shared cores, every small op waits
    for a thread the OS has parked elsewhere, and the suite runs ten times slower when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """New float tensors start as NaN, so an output element (or partial result) a kernel forgets to write
    fails the comparison instead of passing by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))
    yield


# --- real servers -------------------------------------------------------------------------------------------
# Throwaway Redis and PostgreSQL started from the installed binaries, unless CONVOQ_TEST_REDIS_URL /
# CONVOQ_TEST_DATABASE_URL point at servers to use instead (the database URL must allow CREATE DATABASE).


@pytest.fixture(scope="session")
def redis_server():
    from cli.servers import RedisServer, ServerUnavailable

    if os.environ.get("CONVOQ_TEST_REDIS_URL"):
        yield None
        return
    try:
        server = RedisServer().start()
    except ServerUnavailable as exc:
        pytest.exit(f"cannot start a test Redis: {exc}; or set CONVOQ_TEST_REDIS_URL", returncode=3)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return os.environ.get("CONVOQ_TEST_REDIS_URL") or redis_server.url


@pytest.fixture(scope="session")
def postgres_url() -> str:
    from cli.servers import PostgresServer, ServerUnavailable

    if os.environ.get("CONVOQ_TEST_DATABASE_URL"):
        yield os.environ["CONVOQ_TEST_DATABASE_URL"]
        return
    try:
        server = PostgresServer().start()
    except ServerUnavailable as exc:
        pytest.exit(f"cannot start a test PostgreSQL: {exc}; or set CONVOQ_TEST_DATABASE_URL", returncode=3)
    yield server.url
    server.stop()


def _new_database(admin_url: str) -> str:
    """A new empty database on the test server; its URL."""
    import sqlalchemy as sa

    name = f"convoq_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return str(sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False))


@pytest.fixture
def empty_database(postgres_url) -> str:
    return _new_database(postgres_url)


@pytest.fixture
def database(empty_database) -> str:
    """A freshly migrated database of its own for this test."""
    from migrations.apply import upgrade

    upgrade(empty_database)
    return empty_database


@pytest.fixture(params=["postgres", "sqlite"])
def any_database(request, tmp_path) -> str:
    """A database brought to head by the migrations, on each kind the service runs on (SQLite: the demo's)."""
    if request.param == "postgres":
        return request.getfixturevalue("database")
    from migrations.apply import upgrade

    url = f"sqlite:///{tmp_path}/convoq.db"
    upgrade(url)
    return url


@pytest.fixture
def db(database):
    """The migrated test database's engine and sessions, disposed after the test."""
    from store.connections import make_db_engine, make_sessions

    engine = make_db_engine(database)
    yield engine, make_sessions(engine)
    engine.dispose()


@pytest.fixture
def broker(redis_url) -> str:
    """The test Redis, emptied: no messages left by an earlier test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    return redis_url


@pytest.fixture
def service_env(database, broker, tiny_model) -> dict[str, str]:
    return {
        "CONVOQ_DATABASE_URL": database,
        "CONVOQ_BROKER_URL": broker,
        "CONVOQ_MODEL": str(tiny_model),
        "CONVOQ_API_KEYS": API_KEY,
    }


@pytest.fixture
def stack(service_env, tmp_path):
    """API + one worker as real processes against the test servers."""
    from cli.stack import Stack

    with Stack(service_env, tmp_path / "logs") as s:
        s.start_api()
        s.start_worker()
        yield s


@pytest.fixture
def paced(service_env, tmp_path):
    """API + one worker running our engine at a set pace, replies never stopping early (`tests.paced_backend`):
    long enough to follow, cancel or outlive. Its worker's metrics are at `metrics_url`."""
    from cli.servers import free_port
    from cli.stack import Stack

    port = free_port()
    env = {**service_env, "CONVOQ_BACKEND": "tests.paced_backend:create", "CONVOQ_WORKER_METRICS_PORT": str(port),
           "CONVOQ_HEARTBEAT_S": "0.5"}
    with Stack(env, tmp_path / "logs") as stack:
        stack.start_api()
        stack.start_worker()
        stack.metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield stack


@pytest.fixture
def settings(database, broker):
    """Settings for sweeps on the test servers: unpublished jobs are re-sent at once, a sweep runs whenever
    asked. A module that needs other settings defines its own `settings` fixture."""
    from jobs.settings import Settings

    return Settings(database_url=database, broker_url=broker, unpublished_grace_s=0, dead_after_s=30,
                    sweep_every_s=0.01)
