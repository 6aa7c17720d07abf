"""Many threads' database writes of one kind, committed together.

Every Celery thread of a worker claims its job before the run and stores the outcome after it. Done one by one,
each write is its own transaction and round trips, and their Python cost under the GIL is what limits a
process's jobs per second. Here callers hand their item to one writer thread (and wait for it, or not); the
writer takes everything that is waiting and runs it through `flush` as one transaction, so a burst of N jobs
costs a few statements instead of N transactions. A flush that raises is retried item by item, so one bad item
fails alone and the others still commit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class GroupCommit(Generic[In, Out]):
    def __init__(self, flush: Callable[[list[In]], list[Out]], name: str, max_items: int = 256) -> None:
        """`flush(items)` writes all `items` in one transaction and returns one output per item, in order."""
        self.flush = flush
        self.max_items = max_items
        # entries of one or more items each; the items of one entry are flushed together
        self._queue: queue.SimpleQueue[list[tuple[In, Future[Out]]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def __call__(self, item: In) -> Out:
        """Write `item` with whatever else is waiting; returns its output once committed (or raises its error)."""
        return self.submit(item).result()

    def submit(self, item: In) -> Future[Out]:
        """Queue `item` for the next flush without waiting for it."""
        return self.many([item])[0]

    def many(self, items: list[In]) -> list[Future[Out]]:
        """Queue `items` to be written in one flush (a grouped message's jobs: one statement for all of them),
        with whatever else is waiting; one future per item."""
        entry = [(item, Future()) for item in items]
        self._queue.put(entry)
        return [future for _, future in entry]

    def close(self) -> None:
        """Let the writer finish what is queued, then stop it."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            pending = list(first)
            stop = False
            while len(pending) < self.max_items:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                pending += more
            self._write(pending)
            if stop:
                return

    def _write(self, pending: list[tuple[In, Future[Out]]]) -> None:
        try:
            outputs = self.flush([item for item, _ in pending])
        except Exception as exc:
            if len(pending) == 1:
                pending[0][1].set_exception(exc)
                return
            for one in pending:  # find the item that broke it; the rest commit on their own
                self._write([one])
            return
        for (_, future), output in zip(pending, outputs, strict=True):
            future.set_result(output)
