"""Waiting for a condition the system under test reaches in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(condition: Callable[[], T], timeout: float, every: float = 0.2) -> T:
    """The first truthy value of `condition`, asked every `every` seconds; fails the test past `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(every)
    return value
