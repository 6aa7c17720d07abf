"""The worker's way to the database: actions retried while it is away, one-statement writes committed on
their own, text it can store, and a batch settled once its last job ended."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from store.batch_settle import batch_pending, settle_batch

log = logging.getLogger(__name__)
T = TypeVar("T")


def retrying(action: Callable[[], T], what: str, deadline_s: float = 600.0) -> T:
    """Run a database action, retrying with capped exponential backoff while the database is away."""
    delay, start = 0.2, time.monotonic()
    while True:
        try:
            return action()
        except (OperationalError, DBAPIError) as exc:
            if time.monotonic() - start > deadline_s or not transient(exc):
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1fs", what, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def transient(exc: DBAPIError) -> bool:
    """Whether `exc` is a lost connection (the server went away, or ended the session), which a retry can mend."""
    return isinstance(exc, OperationalError) or exc.connection_invalidated


def storable(text: str) -> str:
    """PostgreSQL text cannot hold NUL, which a byte-level tokenizer can produce: store U+FFFD instead."""
    return text.replace("\x00", "\ufffd")


def committing(bind: Engine) -> Connection:
    """A connection whose every statement commits on its own: a write that is one statement needs neither BEGIN nor
    COMMIT, each a round trip of its own."""
    return bind.connect().execution_options(isolation_level="AUTOCOMMIT")


def settle(sessions: sessionmaker[Session], batch_id: uuid.UUID) -> None:
    """`settle_batch` in a transaction of its own, once the batch has no job left pending. Until then (every store
    but a batch's last) the check is one statement committed on its own: a transaction around it would add a
    BEGIN and a COMMIT, each a round trip of the worker's store thread."""
    with committing(sessions.kw["bind"]) as conn:
        if batch_pending(conn, batch_id):
            return
    with sessions.begin() as session:
        settle_batch(session, batch_id)
