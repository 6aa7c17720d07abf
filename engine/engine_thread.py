"""The one thread that owns a model: turns thread-safe `submit()` calls into engine steps.

Callers (Celery task threads, benchmarks, tests) get a `Future[Completion]` per request. Every call into the
engine happens on this thread, so engines need no locks.

When a step raises, one bad request must not take its batch-mates down: every request in flight is taken
out and run again alone, so the one that fails again fails by itself (its completion is `retryable`) and the
others finish. Out-of-memory and device errors are different: the engine's state is then unknown, so the
thread dies, every pending future fails with `EngineDead`, and the process that owns it exits and lets its
supervisor restart it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

import torch

from engine.interface import Completion, Request, RequestError, StepEngine, Timings

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the engine (or the device) cannot be trusted to run anything else."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError | EngineDead) or not isinstance(exc, Exception):
        return True
    return "CUDA" in str(exc) or "device-side" in str(exc)


class EngineThread:
    def __init__(self, engine: StepEngine, name: str = "engine") -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._inbox: deque[tuple[Request, Future]] = deque()
        self._cancels: deque[str] = deque()
        self._futures: dict[str, Future] = {}
        self._requests: dict[str, Request] = {}
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        with self._cv:
            if not self.alive:
                raise EngineDead(f"engine thread is dead: {self.error!r}")
            self._inbox.append((request, future))
            self._cv.notify()
        return future

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._cancels or self.engine.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    new, self._inbox = list(self._inbox), deque()
                    cancels, self._cancels = list(self._cancels), deque()
                for request, future in new:
                    self._add(request, future)
                for request_id in cancels:
                    completion = self.engine.abort_request(request_id)
                    if completion is not None:
                        self._resolve(completion)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # the engine is in an unknown state: fail everything, loudly
            log.exception("engine thread crashed")
            self.error = exc
        finally:
            self._fail_pending()

    def _step(self) -> None:
        try:
            completions = self.engine.step()
        except Exception as exc:
            if is_fatal(exc):
                raise
            log.warning("engine step failed (%s); running its %d requests one by one", exc, len(self._requests))
            self._isolate()
            return
        for completion in completions:
            self._resolve(completion)

    def _isolate(self) -> None:
        """Run every request in flight alone, from the start: only a request that fails alone fails."""
        suspects = list(self._requests.values())
        for request in suspects:
            self.engine.abort_request(request.request_id)
        for request in suspects:
            try:
                self.engine.add_request(request)
                while self.engine.has_unfinished():
                    for completion in self.engine.step():
                        self._resolve(completion)
            except Exception as exc:
                if is_fatal(exc):
                    raise
                self.engine.abort_request(request.request_id)
                self._resolve(Completion(request.request_id, [], "", len(request.prompt_ids), "error",
                                         f"engine error on this request alone: {type(exc).__name__}: {exc}",
                                         Timings(), retryable=True))

    def _add(self, request: Request, future: Future) -> None:
        try:
            self.engine.add_request(request)
        except RequestError as exc:
            future.set_result(
                Completion(request.request_id, [], "", len(request.prompt_ids), "error", str(exc), Timings())
            )
            return
        self._futures[request.request_id] = future
        self._requests[request.request_id] = request

    def _resolve(self, completion: Completion) -> None:
        self._requests.pop(completion.request_id, None)
        future = self._futures.pop(completion.request_id, None)
        if future is not None and not future.done():
            future.set_result(completion)

    def _fail_pending(self) -> None:
        with self._cv:
            pending = [f for _, f in self._inbox] + list(self._futures.values())
            self._inbox.clear()
            self._futures.clear()
            self._requests.clear()
        reason = EngineDead(f"engine thread stopped: {self.error!r}" if self.error else "engine closed")
        for future in pending:
            if not future.done():
                future.set_exception(reason)
