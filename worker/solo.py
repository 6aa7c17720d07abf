"""Running a suspect job with the engine to itself.

A job that was in flight when workers died twice (`jobs.crashes`) may be what kills them, or may only have been
there. Run alone, the question has one answer: if the worker dies now, the job did it, and nobody else is
charged. A run that must be alone waits for the runs in progress to end and holds new ones back until it is done;
suspects take turns. It is rare (a worker holds up to hundreds of jobs, and only repeated crashes make
suspects), so the pause it costs is rare too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Solo:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0  # runs in progress together
        self._waiting = 0  # runs waiting to be alone; new shared runs hold back for them
        self._alone = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and self._waiting == 0)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._alone and self._shared == 0)
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
