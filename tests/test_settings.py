"""Settings: API key entries, scopes, tenants and hashes; connection URLs kept secret."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from jobs.settings import ApiKey, Settings, hash_key, redact

PLAIN, ADMIN = "plain-key-0123456789", "admin-key-0123456789"


def test_keys_scopes_tenants_and_hashed_form():
    digest = hash_key("stored-elsewhere-0123")
    s = Settings(api_keys=f"{PLAIN}@acme, {ADMIN}:admin, sha256={digest}:read+submit@acme")
    assert s.known_keys == {
        hash_key(PLAIN): ApiKey(hash_key(PLAIN), frozenset({"submit", "read"}), "acme"),
        # a key that names no tenant is a tenant of its own
        hash_key(ADMIN): ApiKey(hash_key(ADMIN), frozenset({"admin"}), hash_key(ADMIN)),
        digest: ApiKey(digest, frozenset({"read", "submit"}), "acme"),
    }
    assert PLAIN not in repr(s) and PLAIN not in str(s.model_dump())


@pytest.mark.parametrize("entry", ["short-key-1", "fifteen-chars-1", "good-key-0123456789:superuser",
                                   "sha256=abc:read", "good-key-0123456789@", "good-key-0123456789@a b"])
def test_bad_key_entries_are_refused_at_start_up(entry):
    with pytest.raises(ValidationError):
        Settings(api_keys=entry)


def test_custom_backend_must_be_an_import_path():
    assert Settings(backend="mypkg.backends:create").backend == "mypkg.backends:create"
    with pytest.raises(ValidationError):
        Settings(backend="rm -rf /")


def test_connection_urls_never_show_their_passwords(caplog):
    s = Settings(database_url="postgresql+psycopg://convoq:hunter2-db@db:5432/convoq",
                 broker_url="redis://:hunter2-redis@redis:6379/0")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("convoq.test").info("settings: %s %r", s, s.model_dump())
    shown = repr(s) + str(s) + caplog.text
    assert "hunter2" not in shown
    assert s.database_url.get_secret_value().endswith("@db:5432/convoq")
    assert redact(s.database_url.get_secret_value()) == "postgresql+psycopg://convoq:***@db:5432/convoq"
    assert redact(s.broker_url.get_secret_value()) == "redis://:***@redis:6379/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_the_celery_pool_threads_share_one_result_backend():
    # Celery otherwise builds a backend per thread on its first task, scanning every package's entry points:
    # tens of ms for each of the worker's 256 threads, in the middle of a burst
    import threading

    from broker.app import create_celery

    app = create_celery(Settings())
    seen = []
    thread = threading.Thread(target=lambda: seen.append(app.backend))
    thread.start()
    thread.join()
    assert seen == [app.backend]


def test_the_worker_reads_every_engine_knob_once_with_the_engines_defaults_and_checks(monkeypatch, tmp_path):
    from dataclasses import fields

    from engine import builder
    from engine.config import EngineConfig
    from jobs.schemas import MAX_TOP_LOGPROBS
    from worker.engine_factory import WorkerSettings, engine_options

    engine_fields = {f.name for f in fields(EngineConfig)} - set(builder.SERVICE_FIELDS)
    # declared once: the service's settings hold none of the engine's knobs, the worker's hold all of them
    assert engine_fields & set(Settings.model_fields) == set()
    assert engine_fields <= set(WorkerSettings.model_fields)
    monkeypatch.setenv("CONVOQ_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("CONVOQ_INTERACTIVE_TPOT_MS", "40")
    monkeypatch.setenv("CONVOQ_BLOCK_SIZE", "32")
    settings = WorkerSettings(model=str(tmp_path))
    options = {name: getattr(settings, name) for name in engine_fields}
    assert options == {**{f.name: f.default for f in fields(EngineConfig) if f.name in engine_fields},
                       "max_num_seqs": 12, "interactive_tpot_ms": 40.0, "block_size": 32}
    config = builder.engine_config(settings.model, engine_options(settings))
    assert (config.max_num_seqs, config.max_logprobs) == (12, MAX_TOP_LOGPROBS)  # the contract's bound, passed on
    # what the engine refuses stops the worker at start, with the engine's reason (never silently clamped)
    monkeypatch.setenv("CONVOQ_MAX_NUM_BATCHED_TOKENS", "8")
    with pytest.raises(ValidationError, match="max_num_batched_tokens must be >= max_num_seqs"):
        WorkerSettings()
    monkeypatch.setenv("CONVOQ_MAX_NUM_BATCHED_TOKENS", "4096")
    monkeypatch.setenv("CONVOQ_KV_CACHE_DTYPE", "int3")
    with pytest.raises(ValidationError, match="unknown kv_cache_dtype"):
        WorkerSettings()


def test_speculation_is_the_services_setting_carried_into_the_engines_config(monkeypatch, tmp_path):
    from engine import builder
    from worker.engine_factory import WorkerSettings, engine_options

    assert builder.engine_config(tmp_path, engine_options(WorkerSettings())).speculative == "ngram"
    monkeypatch.setenv("CONVOQ_SPECULATIVE", "off")
    monkeypatch.setenv("CONVOQ_SPECULATIVE_TOKENS", "4")
    settings = WorkerSettings()
    assert Settings().speculative == settings.speculative == "off"
    config = builder.engine_config(tmp_path, engine_options(settings))
    assert (config.speculative, config.speculative_tokens) == ("off", 4)
    monkeypatch.setenv("CONVOQ_SPECULATIVE", "eagle")
    with pytest.raises(ValidationError, match="speculative"):
        WorkerSettings()
