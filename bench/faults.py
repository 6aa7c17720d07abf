"""A fault no signal can cause, for the chaos benchmark and the fault tests: database commits whose reply is lost.

    CONVOQ_BACKEND=bench.faults:lost_replies CONVOQ_LOST_REPLY_EVERY=5 CONVOQ_ENGINE_PROCESS=false convoq worker

The worker runs our engine as usual, but one commit in CONVOQ_LOST_REPLY_EVERY (of claims, results, retries,
heartbeats, sweeps: every session of the process) raises after the database committed, as a connection cut
between COMMIT and its reply would. Each write must then find, when it retries, that it already happened.
The fault is installed where the backend is built, so the engine runs as a thread of the worker here
(`lost_replies_env`): in a process of its own it would break that process's commits, of which it has none.
"""

from __future__ import annotations

import itertools
import logging
import os

from sqlalchemy import event
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
    """From now on, every `every`-th commit of any session in this process loses its reply."""
    commits = itertools.count(1)

    @event.listens_for(Session, "after_commit")
    def _lose(session: Session) -> None:
        if next(commits) % every == 0:
            log.warning("injected: the reply to a COMMIT is lost")
            raise OperationalError("COMMIT", {}, ConnectionResetError("injected: reply lost"))


def lost_replies(model: str, device: str, dtype: str) -> LLMEngine:
    lose_replies(int(os.environ.get("CONVOQ_LOST_REPLY_EVERY", "5")))
    return LLMEngine(engine_config(WorkerSettings(model=model, device=device, dtype=dtype)))
