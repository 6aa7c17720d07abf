"""A fault no signal can cause, for the chaos benchmark and the fault tests: database commits whose reply is lost.

    CONVOQ_BACKEND=bench.faults:lost_replies CONVOQ_LOST_REPLY_EVERY=5 CONVOQ_ENGINE_PROCESS=false convoq worker

The worker runs our engine as usual, but one commit in CONVOQ_LOST_REPLY_EVERY (of claims, results, retries,
heartbeats, sweeps: every transaction and autocommitted statement of the process) raises after the database committed, as a connection cut
between COMMIT and its reply would. Each write must then find, when it retries, that it already happened.
The fault is installed where the backend is built, so the engine runs as a thread of the worker here
(`lost_replies_env`): in a process of its own it would break that process's commits, of which it has none.
"""

from __future__ import annotations

import itertools
import logging
import os

from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from engine.llm_engine import LLMEngine
from worker.engine_factory import WorkerSettings, engine_config

log = logging.getLogger(__name__)


def lost_replies_env(every: int) -> dict[str, str]:
    """The environment of a worker whose commits lose one reply in `every`."""
    return {"CONVOQ_BACKEND": "bench.faults:lost_replies", "CONVOQ_LOST_REPLY_EVERY": str(every),
            "CONVOQ_ENGINE_PROCESS": "false"}


def lose_replies(every: int) -> None:
    """From now on, every `every`-th commit in this process loses its reply: a session's COMMIT, or a statement
    that commits on its own (run with autocommit, as the worker's claims and stores on PostgreSQL are)."""
    commits = itertools.count(1)

    def lost() -> bool:
        if next(commits) % every:
            return False
        log.warning("injected: the reply to a COMMIT is lost")
        return True

    def reply_lost() -> OperationalError:
        return OperationalError("COMMIT", {}, ConnectionResetError("injected: reply lost"))

    @event.listens_for(Session, "after_commit")
    def _committed(_session: Session) -> None:
        if lost():
            raise reply_lost()

    @event.listens_for(Engine, "after_execute")
    def _autocommitted(conn: Connection, *_) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT" and lost():
            conn.invalidate()  # as a cut connection is: its server session ends, with whatever lock it held
            raise reply_lost()


def lost_replies(model: str, device: str, dtype: str) -> LLMEngine:
    lose_replies(int(os.environ.get("CONVOQ_LOST_REPLY_EVERY", "5")))
    return LLMEngine(engine_config(WorkerSettings(model=model, device=device, dtype=dtype)))
