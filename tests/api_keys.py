"""The API keys the test services accept, and the header that presents one."""

from __future__ import annotations

API_KEY = "test-key-0123456789"
OTHER_KEY = "other-key-0123456789"  # another tenant's key: its jobs and batches are not API_KEY's
ADMIN_KEY = "admin-key-0123456789"  # given the admin scope by the settings that accept it


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


AUTH = auth()
