"""A worker's shutdown has a time limit, and costs the jobs in flight a wait, never a crash.

A warm shutdown (SIGTERM: a deploy, a scale-down) takes no new message and gives the jobs in flight
`CONVOQ_SHUTDOWN_GRACE_S` to finish; a cold one (SIGQUIT) gives them none. Then every run still going is stopped
(finish reason `shutdown`), its job handed back uncharged (neither an attempt nor a crash: its worker did not die)
and its message returned to the queue, where the next worker takes it at once. A message delivered but not yet
started goes back unclaimed as soon as the shutdown begins. The grace stays below the supervisor's wait before
SIGKILL (compose's `stop_grace_period`): a kill would leave the jobs to expire, and the sweep to charge them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from worker.outcome import SHUTDOWN


class Shutdown:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.begun = threading.Event()  # no new claims: messages go back to the queue
        self.over = threading.Event()  # the grace is spent: runs are stopped, and new ones stop as they start
        self._cut = threading.Event()  # a cold shutdown: no grace

    def start(self, stop_runs: Callable[[str], object]) -> None:
        """Watch for the shutdown from now on; `stop_runs(reason)` stops every run in flight with that finish
        reason. A thread of its own, started now, so that `begin`, called in a signal handler, only sets events:
        starting a thread there could wait on a lock the interrupted main thread holds."""
        threading.Thread(target=self._run, args=(stop_runs,), name="shutdown", daemon=True).start()

    def begin(self, cold: bool = False) -> None:
        if cold:
            self._cut.set()
        self.begun.set()

    def _run(self, stop_runs: Callable[[str], object]) -> None:
        self.begun.wait()
        self._cut.wait(self.grace_s)
        self.over.set()  # before the runs are listed: a run that starts after the listing sees it (`tasks`)
        stop_runs(SHUTDOWN)
