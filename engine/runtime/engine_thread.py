"""The one thread that owns a model: turns thread-safe `submit()` calls into engine steps.

Every call into the engine happens on this thread, so engines need no locks. When a step raises, every
request in flight runs again alone, so only a request that fails alone fails (`retryable`); after
out-of-memory and device errors the engine's state is unknown, so the thread dies, pending futures fail with
`EngineDead`, and the process exits for its supervisor to restart. Between steps it stops cancelled requests
and those past their deadline (`expired`, their text so far kept), hands `on_tokens` the output every
`progress_every` tokens, and measures its idle gaps between back-to-back steps (`loop_gap_p95_ms` in `stats()`).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import replace

import torch

from engine.interface import Completion, Request, RequestError, StepEngine, TokensCallback
from engine.runtime.loop_gaps import LoopGaps

log = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    pass


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the engine (or the device) cannot be trusted to run anything else."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError | EngineDead) or not isinstance(exc, Exception):
        return True
    return "CUDA" in str(exc) or "device-side" in str(exc)


class EngineThread:
    def __init__(self, engine: StepEngine, name: str = "engine", progress_every: int = 4) -> None:
        self.engine = engine
        self.progress_every = progress_every
        self.error: BaseException | None = None
        # A backend may offer `prepare(request)`: checks and set-up that read nothing a step changes, done here on
        # the submitting thread, so that a burst of new requests never widens the gap between two steps; what
        # it returns goes to `add_request`.
        self._prepare = getattr(engine, "prepare", None)
        self._inbox: deque[tuple[Request, object, Future, TokensCallback | None]] = deque()
        self._adding: deque[tuple[Request, object, Future, TokensCallback | None]] = deque()  # taken from the inbox
        self._cancels: deque[tuple[str, str]] = deque()  # (request id, finish reason)
        self._futures: dict[str, Future] = {}
        self._requests: dict[str, Request] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request id)
        self._watched: dict[str, tuple[TokensCallback, int]] = {}  # request id -> (callback, tokens reported)
        self._cv = threading.Condition()
        self._stopping = False
        self.gaps = LoopGaps()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def tokenizer(self) -> object:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def submit(self, request: Request, on_tokens: TokensCallback | None = None) -> Future:
        future: Future = Future()
        prepared = None
        if self._prepare is not None:
            try:
                prepared = self._prepare(request)
            except RequestError as exc:
                future.set_result(Completion.empty(request.request_id, len(request.prompt_ids), "error", str(exc)))
                return future
        with self._cv:
            if not self.alive:
                raise EngineDead(f"engine thread is dead: {self.error!r}")
            self._inbox.append((request, prepared, future, on_tokens))
            self._cv.notify()
        return future

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request before its next step; its completion's finish reason is `reason`."""
        with self._cv:
            self._cancels.append((request_id, reason))
            self._cv.notify()

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "loop_gap_p50_ms": 1e3 * self.gaps.percentile(0.5),
                "loop_gap_p95_ms": 1e3 * self.gaps.percentile(0.95), "loop_gaps": self.gaps.total}

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop ends: closed, or crashed (then `error` says why)."""
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._cancels or self.engine.has_unfinished()):
                        self.gaps.step_ended = None  # idle for want of work: not a gap between steps
                        self._cv.wait()
                    if self._stopping:
                        break
                    self._adding, self._inbox = self._inbox, deque()
                    cancels, self._cancels = list(self._cancels), deque()
                while self._adding:  # each leaves only once added: one that crashes the loop fails with the rest
                    self._add(*self._adding[0])
                    self._adding.popleft()
                for request_id, reason in cancels:
                    self._stop(request_id, reason)
                self._expire(time.monotonic())
                if self.engine.has_unfinished():
                    if self.gaps.step_ended is not None:
                        self.gaps.observe(time.perf_counter() - self.gaps.step_ended)
                    self._step()
                    self.gaps.step_ended = time.perf_counter()
                    self._report_tokens()
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
                self._resolve(Completion.empty(request.request_id, len(request.prompt_ids), "error",
                                               f"engine error on this request alone: {type(exc).__name__}: {exc}",
                                               retryable=True))

    def _add(self, request: Request, prepared: object, future: Future, on_tokens: TokensCallback | None) -> None:
        rid, n = request.request_id, len(request.prompt_ids)
        if request.deadline is not None and request.deadline <= time.monotonic():
            future.set_result(Completion.empty(rid, n, "expired"))
            return
        try:
            if prepared is None:
                self.engine.add_request(request)
            else:
                self.engine.add_request(request, prepared)
        except RequestError as exc:
            future.set_result(Completion.empty(rid, n, "error", str(exc)))
            return
        self._futures[rid] = future
        self._requests[rid] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, rid))
        if on_tokens is not None:
            self._watched[rid] = (on_tokens, 0)

    def _stop(self, request_id: str, reason: str) -> None:
        completion = self.engine.abort_request(request_id)
        if completion is not None:
            self._resolve(replace(completion, finish_reason=reason))

    def _expire(self, now: float) -> None:
        if len(self._deadlines) > 2 * len(self._requests) + 1024:  # mostly requests that finished in time
            self._deadlines = [(d, rid) for d, rid in self._deadlines if rid in self._requests]
            heapq.heapify(self._deadlines)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if request_id in self._requests:
                self._stop(request_id, "expired")

    def _report_tokens(self) -> None:
        for request_id, (on_tokens, reported) in list(self._watched.items()):
            tokens = self.engine.partial(request_id, reported + self.progress_every)
            if tokens is not None:
                self._watched[request_id] = (on_tokens, len(tokens))
                try:
                    on_tokens(tokens)
                except Exception:  # a progress report is never worth a request
                    log.exception("progress callback of %s failed", request_id)

    def _resolve(self, completion: Completion) -> None:
        self._watched.pop(completion.request_id, None)
        self._requests.pop(completion.request_id, None)
        future = self._futures.pop(completion.request_id, None)
        if future is not None and not future.done():
            future.set_result(completion)

    def _fail_pending(self) -> None:
        with self._cv:
            pending = [f for _, _, f, _ in [*self._adding, *self._inbox]] + list(self._futures.values())
            self._adding.clear()
            self._inbox.clear()
            self._futures.clear()
            self._requests.clear()
        reason = EngineDead(f"engine thread stopped: {self.error!r}" if self.error else "engine closed")
        for future in pending:
            if not future.done():
                future.set_exception(reason)
