"""Settings of a service under test: its database and broker, and the test keys it accepts."""

from __future__ import annotations

from pathlib import Path

from jobs.settings import Settings
from tests.api_keys import ADMIN_KEY, API_KEY, OTHER_KEY

UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"  # for code that builds a Celery app but never sends


def settings_for(database: str, broker: str = UNREACHABLE_BROKER, model: Path | None = None, **fields) -> Settings:
    """Settings on `database` and `broker` accepting API_KEY, OTHER_KEY and ADMIN_KEY (as admin); `model` is the
    checkpoint the API reads its tokenizer from, the default one when None."""
    if model is not None:
        fields["model"] = str(model)
    return Settings(database_url=database, broker_url=broker, api_keys=f"{API_KEY},{OTHER_KEY},{ADMIN_KEY}:admin",
                    **fields)
