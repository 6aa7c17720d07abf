"""A worker's shutdown has a time limit, and costs the jobs in flight a wait, never a crash.

A warm shutdown (SIGTERM: a deploy, a scale-down) takes no new message and gives the jobs in flight
`CONVOQ_SHUTDOWN_GRACE_S` to finish; a cold one (SIGQUIT) gives them none. Then every run still going is stopped
(finish reason `shutdown`), its job handed back uncharged (neither an attempt nor a crash: its worker did not die)
and its message returned to the queue, where the next worker takes it at once. A message delivered but not yet
started goes back unclaimed as soon as the shutdown begins. The grace stays below the supervisor's wait before
SIGKILL (compose's `stop_grace_period`): a kill would leave the jobs to expire, and the sweep to charge them.

The worker drains from the moment its shutdown begins, not once the grace is spent: its row says so at once (the
router places no conversation on it any more) and what waits in its own queues moves to the shared ones, where
the next worker takes it now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.interface import FinishReason

log = logging.getLogger(__name__)


class Shutdown:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.begun = threading.Event()  # no new claims; messages go back to the queue
        self.over = threading.Event()  # the grace is spent; runs are stopped, and new ones stop as they start
        self._cut = threading.Event()  # a cold shutdown, with no grace

    def start(self, stop_runs: Callable[[FinishReason], object], drain: Callable[[], object] = lambda: None) -> None:
        """Watch for the shutdown from now on; `stop_runs(reason)` stops every run in flight with that finish
        reason, and `drain()` is called as soon as the shutdown begins (a cold one's runs are stopped first). A
        thread of its own, started now, so that `begin`, called in a signal handler, only sets events: starting a
        thread there could wait on a lock the interrupted main thread holds."""
        threading.Thread(target=self._run, args=(stop_runs, drain), name="shutdown", daemon=True).start()

    def begin(self, cold: bool = False) -> None:
        if cold:
            self._cut.set()
        self.begun.set()

    def _run(self, stop_runs: Callable[[FinishReason], object], drain: Callable[[], object]) -> None:
        self.begun.wait()
        began, cold = time.monotonic(), self._cut.is_set()
        if not cold:
            drained(drain)
        self._cut.wait(max(0.0, self.grace_s - (time.monotonic() - began)))
        self.over.set()  # before the runs are listed, so a run that starts later sees it (`worker.runs.opened`)
        stop_runs(FinishReason.shutdown)
        if cold:
            drained(drain)


def drained(drain: Callable[[], object]) -> None:
    try:
        drain()
    except Exception:  # the sweep moves what it could not, once it sees this worker draining
        log.exception("could not drain this worker at the start of its shutdown")
