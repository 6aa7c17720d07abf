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

    from jobs.broker import create_celery

    app = create_celery(Settings())
    seen = []
    thread = threading.Thread(target=lambda: seen.append(app.backend))
    thread.start()
    thread.join()
    assert seen == [app.backend]
