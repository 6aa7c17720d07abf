"""The one thread that owns a model: turns thread-safe `submit()` calls into engine steps.

Every call into the engine happens on this thread, so engines need no locks. When a step raises, the requests
in it are bisected: half of them go back into the engine and the other half wait in this thread, while the loop
goes on taking new work, cancels and deadlines; a step that fails again is halved again, and a waiting half
goes in once the half before it is through. Only a request that fails alone fails (`retryable`). After
out-of-memory and device errors the engine's state is unknown, so the thread dies, pending futures fail with
`EngineDead`, and the process exits for its supervisor to restart. Between steps it stops cancelled requests
and those past their deadline (`expired`, their text so far kept), hands `on_tokens` the output every
`progress_every` tokens, and measures its idle gaps between back-to-back steps (`loop_gap_p95_ms` in `stats()`).
It counts its turns (`progress()`), which is how a watchdog tells a stalled loop from an idle one.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import torch

from engine.interface import (
    Completion,
    EngineDead,
    EngineStalled,
    EngineStats,
    FinishReason,
    Request,
    RequestError,
    StepEngine,
    TokensCallback,
)
from engine.runtime.loop_gaps import LoopGaps
from engine.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the engine (or the device) cannot be trusted to run anything else."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError | EngineDead) or not isinstance(exc, Exception):
        return True
    return "CUDA" in str(exc) or "device-side" in str(exc)


class EngineThread:
    def __init__(self, engine: StepEngine, name: str = "engine", progress_every: int = 4,
                 stall_s: float | None = None, on_stall: Callable[[EngineStalled], None] | None = None) -> None:
        """With `stall_s` and `on_stall`, a watchdog calls `on_stall` once the loop has had work and no progress
        for `stall_s`. A thread cannot be killed: what to do with it and its requests is the owner's call."""
        self.engine = engine
        self.progress_every = progress_every
        self.error: BaseException | None = None
        # A backend may offer `prepare(request)`: checks and set-up that read nothing a step changes, done here on
        # the submitting thread, so that a burst of new requests never widens the gap between two steps; what
        # it returns goes to `add_request`.
        self._prepare = getattr(engine, "prepare", None)
        self._inbox: deque[tuple[Request, object, Future, TokensCallback | None]] = deque()
        self._adding: deque[tuple[Request, object, Future, TokensCallback | None]] = deque()  # taken from the inbox
        self._cancels: deque[tuple[str, FinishReason]] = deque()  # (request id, finish reason)
        self._futures: dict[str, Future] = {}
        self._requests: dict[str, Request] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap of (deadline, request id)
        self._watched: dict[str, tuple[TokensCallback, int]] = {}  # request id -> (callback, tokens reported)
        # bisection of failed steps: halves of suspects waiting in this thread, each request with its text at the
        # failure (kept if it is stopped while it waits); and the half now back in the engine
        self._held: list[dict[str, Completion | None]] = []
        self._trial: set[str] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._waiting = False  # the loop is waiting for work
        self.turns = 0  # passes of the loop: the progress a watchdog looks for
        self.gaps = LoopGaps()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._watchdog = None
        if stall_s is not None and on_stall is not None:
            self._watchdog = Watchdog(stall_s, lambda: self.progress()[1],
                                      lambda why: on_stall(EngineStalled(f"the engine thread stalled: {why}")),
                                      sample=self.progress, name=f"{name}-watchdog")

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
                future.set_result(Completion.empty(request.request_id, len(request.prompt_ids), FinishReason.error, str(exc)))
                return future
        with self._cv:
            if not self.alive:
                raise EngineDead(f"engine thread is dead: {self.error!r}")
            self._inbox.append((request, prepared, future, on_tokens))
            self._cv.notify()
        return future

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.cancelled) -> None:
        """Stop a request before its next step; its completion's finish reason is `reason`."""
        with self._cv:
            self._cancels.append((request_id, reason))
            self._cv.notify()

    def stats(self) -> EngineStats:
        # a thread is never restarted: its stall ends its worker (`EngineProcess` counts its restarts)
        return replace(self.engine.stats(), loop_gap_p50_ms=1e3 * self.gaps.percentile(0.5),
                       loop_gap_p95_ms=1e3 * self.gaps.percentile(0.95), loop_gaps=self.gaps.total, restarts=0)

    def progress(self) -> tuple[int, bool]:
        """The loop's turns so far, and whether it has work (anything but waiting idle for a request)."""
        return self.turns, not self._waiting or bool(self._inbox or self._cancels)

    def close(self, timeout: float = 10.0) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if not self._thread.is_alive() and (close := getattr(self.engine, "close", None)) is not None:
            close()  # what the engine holds beyond this process (a tensor-parallel engine's other ranks)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop ends: closed, or crashed (then `error` says why)."""
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._cancels or self._held
                               or self.engine.has_unfinished()):
                        self.gaps.step_ended = None  # idle for want of work: not a gap between steps
                        self._waiting = True
                        self._cv.wait()
                    self._waiting = False
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
                self._readmit()
                if self.engine.has_unfinished():
                    if self.gaps.step_ended is not None:
                        self.gaps.observe(time.perf_counter() - self.gaps.step_ended)
                    self._step()
                    self.gaps.step_ended = time.perf_counter()
                    self._report_tokens()
                self.turns += 1
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
            self._bisect(exc)
            return
        for completion in completions:
            self._resolve(completion)

    def _bisect(self, exc: Exception) -> None:
        """A step failed: every request in the engine is a suspect, and starts again. Alone, it fails; else the
        more urgent half goes back into the engine and the other half waits here for its turn (`_readmit`)."""
        held = {rid for group in self._held for rid in group}
        suspects = sorted((r for rid, r in self._requests.items() if rid not in held), key=lambda r: -r.priority)
        if not suspects:  # it failed with nothing of ours in it: nothing to blame but the engine
            raise exc
        text_so_far = {r.request_id: self.engine.abort_request(r.request_id) for r in suspects}
        if len(suspects) == 1:
            [request] = suspects
            self._resolve(Completion.empty(request.request_id, len(request.prompt_ids), FinishReason.error,
                                           f"engine error on this request alone: {type(exc).__name__}: {exc}",
                                           retryable=True))
            return
        log.warning("engine step failed (%s); bisecting its %d requests", exc, len(suspects))
        half = len(suspects) // 2
        self._held.append({r.request_id: text_so_far[r.request_id] for r in suspects[half:]})
        self._admit(suspects[:half])

    def _readmit(self) -> None:
        """The next waiting half of suspects goes into the engine once the half before it is through."""
        if self._held and not any(rid in self._requests for rid in self._trial):
            self._admit([self._requests[rid] for rid in self._held.pop()])

    def _admit(self, suspects: list[Request]) -> None:
        self._trial = {r.request_id for r in suspects}
        for request in suspects:
            try:
                self.engine.add_request(request)
            except Exception as exc:
                if is_fatal(exc):
                    raise
                self._resolve(Completion.empty(request.request_id, len(request.prompt_ids), FinishReason.error,
                                               f"engine error taking it back in: {type(exc).__name__}: {exc}",
                                               retryable=True))

    def _add(self, request: Request, prepared: object, future: Future, on_tokens: TokensCallback | None) -> None:
        rid, n = request.request_id, len(request.prompt_ids)
        if request.deadline is not None and request.deadline <= time.monotonic():
            future.set_result(Completion.empty(rid, n, FinishReason.expired))
            return
        try:
            if prepared is None:
                self.engine.add_request(request)
            else:
                self.engine.add_request(request, prepared)
        except RequestError as exc:
            future.set_result(Completion.empty(rid, n, FinishReason.error, str(exc)))
            return
        self._futures[rid] = future
        self._requests[rid] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, rid))
        if on_tokens is not None:
            self._watched[rid] = (on_tokens, 0)

    def _stop(self, request_id: str, reason: FinishReason) -> None:
        group = next((g for g in self._held if request_id in g), None)
        if group is not None:  # a suspect waiting for its turn ends at once, with its text at the failure
            request, completion = self._requests[request_id], group.pop(request_id)
            completion = completion or Completion.empty(request_id, len(request.prompt_ids), reason)
        else:
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
                self._stop(request_id, FinishReason.expired)

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
            self._held.clear()
        reason = EngineDead(f"engine thread stopped: {self.error!r}" if self.error else "engine closed")
        for future in pending:
            if not future.done():
                future.set_exception(reason)
