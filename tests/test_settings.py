"""Settings: API key entries, scopes and hashes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jobs.settings import Settings, hash_key


def test_keys_scopes_and_hashed_form():
    digest = hash_key("stored-elsewhere")
    s = Settings(api_keys=f"plain-key-1, admin-key-1:admin, sha256={digest}:read+submit")
    assert s.api_key_scopes == {
        hash_key("plain-key-1"): frozenset({"submit", "read"}),
        hash_key("admin-key-1"): frozenset({"admin"}),
        digest: frozenset({"read", "submit"}),
    }
    assert "plain-key-1" not in repr(s) and "plain-key-1" not in str(s.model_dump())


@pytest.mark.parametrize("entry", ["short", "good-key-1:superuser", "sha256=abc:read"])
def test_bad_key_entries_are_refused(entry):
    with pytest.raises(ValidationError):
        Settings(api_keys=entry)


def test_custom_backend_must_be_an_import_path():
    assert Settings(backend="mypkg.backends:create").backend == "mypkg.backends:create"
    with pytest.raises(ValidationError):
        Settings(backend="rm -rf /")
