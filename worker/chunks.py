"""The sweep works in chunks, each its own short transaction, so that its cost follows the backlog and no
statement nears the driver's parameter limit."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

CHUNK = 1000  # rows per statement, which bounds each transaction and keeps each IN list short
# A sweep calls this before each chunk. It raises once the sweep may no longer go on (`worker.sweep.sweep_lock`).
Hold = Callable[[], object] | None


def keep_hold(hold: Hold) -> None:
    """Check, before a chunk, that the sweep still holds its lock."""
    if hold is not None:
        hold()


def chunks(ids: list[uuid.UUID]) -> Iterator[list[uuid.UUID]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]
