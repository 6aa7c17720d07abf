"""Whether an engine loop is stalled: it has had work for `stall_s` and its turn counter has not moved since.

Progress is judged from the loop's own counter of turns (`EngineThread.progress()`), read directly for a thread
or carried by the beats an engine process sends from a thread that is not its loop. So a frozen process (no
beats at all) and a loop stuck inside one step (beats with the same count) both stall, while an idle engine
(nothing to do, however long) never does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, stall_s: float, has_work: Callable[[], bool], on_stall: Callable[[str], None],
                 sample: Callable[[], tuple[int, bool]] | None = None, name: str = "engine-watchdog") -> None:
        """Every `every_s` (a quarter of `stall_s`, at most a second): while `has_work()`, call `on_stall(why)`
        once the loop has not turned for `stall_s`. Readings come from `beat(turns, busy)`, or from `sample()`
        where the loop can be read directly."""
        self.stall_s = stall_s
        self.every_s = min(1.0, stall_s / 4)
        self._has_work = has_work
        self._on_stall = on_stall
        self._sample = sample
        self._lock = threading.Lock()
        self._turns: int | None = None
        self._moved_at = time.monotonic()  # the last sign of progress: a new turn, or nothing to do
        self._work_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def beat(self, turns: int, busy: bool) -> None:
        """A reading of the loop: how many turns it has made, and whether it has work."""
        with self._lock:
            if turns != self._turns or not busy:
                self._moved_at = time.monotonic()
            self._turns = turns

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        ticked = time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            # a tick that came this late means this process was frozen (SIGSTOP, a paused VM) along with what it
            # watches: the engine gets its turns (and its beats are read) before it is judged again
            if now - ticked > self.stall_s / 2:
                with self._lock:
                    self._moved_at, self._work_since = now, None
                ticked = now
                continue
            ticked = now
            if self._sample is not None:
                self.beat(*self._sample())
            now = time.monotonic()
            if not self._has_work():
                self._work_since = None
                continue
            if self._work_since is None:
                self._work_since = now
            with self._lock:
                since = max(self._moved_at, self._work_since)
            if now - since < self.stall_s:
                continue
            try:
                self._on_stall(f"its loop made no progress for {now - since:.0f}s with work waiting")
            except Exception:
                log.exception("handling a stalled engine failed")
            with self._lock:  # whatever runs the work now starts with a clean slate
                self._moved_at, self._work_since = time.monotonic(), None
