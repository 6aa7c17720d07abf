"""Waiting, through the API under test, for a batch's lines to be read."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from tests.api_keys import API_KEY, auth


def ingested(client: TestClient, batch_id: str, key: str = API_KEY) -> dict:
    """The batch as `key` sees it once its lines were read (its ingest runs after the answer)."""
    deadline = time.monotonic() + 30
    while (batch := client.get(f"/v1/batches/{batch_id}", headers=auth(key)).json())["status"] == "validating":
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    return batch
