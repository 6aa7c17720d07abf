"""A fault no signal can cause, for the chaos benchmark and the fault tests: database commits whose reply is lost.

    CONVOQ_BACKEND=bench.faults:lost_replies CONVOQ_LOST_REPLY_EVERY=5 CONVOQ_ENGINE_PROCESS=false convoq worker

The worker runs our engine as usual, but one commit in CONVOQ_LOST_REPLY_EVERY (of claims, results, retries,
heartbeats, sweeps: every transaction and autocommitted statement of the process) raises after the database
committed, as a connection cut between COMMIT and its reply would. Each write must then find, when it retries,
that it already happened. The fault is installed where the backend is built, so the engine runs as a thread of the worker here
(`lost_replies_env`): in a process of its own it would break that process's commits, of which it has none.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable

from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from engine import builder
from engine.llm_engine import LLMEngine
from worker.engine_factory import WorkerSettings, engine_options

log = logging.getLogger(__name__)


def lost_replies_env(every: int) -> dict[str, str]:
    """The environment of a worker whose commits lose one reply in `every`."""
    return {"CONVOQ_BACKEND": "bench.faults:lost_replies", "CONVOQ_LOST_REPLY_EVERY": str(every),
            "CONVOQ_ENGINE_PROCESS": "false"}


def lose_replies(every: int) -> None:
    """From now on, every `every`-th commit of this process loses its reply."""
    commits = itertools.count(1)

    def lost() -> bool:
        if next(commits) % every:
            return False
        log.warning("injected: the reply to a COMMIT is lost")
        return True

    lose_replies_of(Session, Engine, lost)


def lose_replies_of(sessions: type[Session] | sessionmaker, engine: type[Engine] | Engine,
                    lost: Callable[[], bool]) -> None:
    """From now on, a commit whose reply `lost()` says is lost raises after the database committed: a COMMIT of
    `sessions`, or a statement `engine` runs with autocommit (it commits on its own, as the worker's claims and
    stores on PostgreSQL do); that statement's connection goes too, as a cut one would, and its server session
    with whatever lock it held. `Session` and `Engine`: every session and engine of the process."""

    def reply_lost() -> OperationalError:
        return OperationalError("COMMIT", {}, ConnectionResetError("injected: reply lost"))

    @event.listens_for(sessions, "after_commit")
    def _committed(_session: Session) -> None:
        if lost():
            raise reply_lost()

    @event.listens_for(engine, "after_execute")
    def _autocommitted(conn: Connection, *_) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT" and lost():
            conn.invalidate()
            raise reply_lost()


def lost_replies(model: str, device: str, dtype: str) -> LLMEngine:
    lose_replies(int(os.environ.get("CONVOQ_LOST_REPLY_EVERY", "5")))
    return LLMEngine(builder.engine_config(model, engine_options(WorkerSettings(model=model, device=device, dtype=dtype))))
