"""The engine in a process of its own, behind the same face as `EngineThread`: the worker's handle on it.

A worker's Celery threads share one interpreter lock; with the engine among them every step waits for it and
a GPU idles as long. So the model and its loop (an `EngineThread`) live in a spawned process that runs nothing
else (`engine.runtime.engine_child`), talking to this side over a pipe (`engine.runtime.pipe_protocol`).

When the child dies the pipe closes and pending futures fail with `EngineDead`. A child that stalls (no beat,
or beats with the same count of loop turns, for `stall_s` while requests wait on it) is killed: its pending
futures fail with `EngineStalled` and a new child takes its place. What is submitted while the new one loads
(minutes, for a large model) waits here and goes in once it is up; a cancel ends such a request at once, so a
job's cancel or deadline never waits for a reload.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engine.interface import (
    Completion,
    EngineDead,
    EngineStalled,
    EngineStats,
    FinishReason,
    Request,
    StepEngine,
    TokensCallback,
)
from engine.runtime.engine_child import serve
from engine.runtime.pipe_protocol import (
    Beat,
    Cancel,
    Close,
    Dead,
    Done,
    Failed,
    Message,
    Outbox,
    StatsQuery,
    StatsReply,
    Submit,
    Tokens,
)
from engine.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


class Spawned:
    """One engine process, and this side of its pipe."""

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.outbox = Outbox(conn)
        self.reader: threading.Thread | None = None
        self.death = "the engine process exited"  # why the pipe closed, as far as the child said
        self.stalled: str | None = None  # why the watchdog killed it
        self.failed = False  # what waited on it has failed (`EngineProcess._fail_pending`, once)


# how long a restart waits for the killed child's reader to end (its pipe closed): one stuck in a progress
# callback is not waited for, and what waited on the child fails without it
READER_JOIN_S = 10.0


class EngineProcess:
    def __init__(self, factory: Callable[[], StepEngine], tokenizer: object, name: str = "engine",
                 on_death: Callable[[EngineDead], None] | None = None, start_timeout: float = 1800.0,
                 stall_s: float | None = None) -> None:
        """Spawn a process that builds its engine with `factory` (picklable: a module-level function or a
        `functools.partial` of one) and runs it. `tokenizer` is this side's copy, for rendering prompts and
        reading progress. Blocks until the engine is loaded.

        With `stall_s`, a watchdog kills an engine whose loop has made no progress for that long while requests
        wait on it (they fail with `EngineStalled`) and starts a new one; submits meanwhile wait for it. If the
        new one cannot start, the engine is dead (`on_death`)."""
        self._factory, self._name, self._start_timeout = factory, name, start_timeout
        self._beat_s = 1.0 if stall_s is None else min(1.0, stall_s / 4)
        self.tokenizer = tokenizer
        self.on_death = on_death
        self.error: BaseException | None = None
        self.restarts = 0
        self._child, self.max_model_len = self._spawn()
        self._lock = threading.Condition()  # also signals the end of a restart
        self._futures: dict[str, Future[Completion]] = {}
        self._watched: dict[str, tuple[TokensCallback, list[int]]] = {}  # request id -> (callback, tokens so far)
        self._stats: dict[int, Future[EngineStats]] = {}
        self._stats_numbers = itertools.count()
        self._closing = False
        self._restarting = False
        # submits that came during a restart, sent to the new child once it is up: request id -> (message, future)
        self._held: dict[str, tuple[Submit, Future[Completion]]] = {}
        self._read_from(self._child)
        self._watchdog = None if stall_s is None else Watchdog(stall_s, lambda: bool(self._futures), self._stalled,
                                                                name=f"{name}-watchdog")

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closing

    @property
    def pid(self) -> int | None:
        return self._child.process.pid

    def submit(self, request: Request, on_tokens: TokensCallback | None = None) -> Future[Completion]:
        """Never waits: during a restart the request is held here until the new engine is up."""
        future: Future[Completion] = Future()
        message = Submit(request, on_tokens is not None)
        with self._lock:
            if not self.alive:
                raise EngineDead(f"engine process is dead: {self.error!r}")
            if on_tokens is not None:
                self._watched[request.request_id] = (on_tokens, [])
            if self._restarting:
                self._held[request.request_id] = (message, future)
                return future
            self._futures[request.request_id] = future
            child = self._child
        child.outbox.put(message)
        return future

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.cancelled) -> None:
        """Stop a request before its next step; its completion's finish reason is `reason`. Never waits on the
        engine: a request held for an engine that is restarting ends at once, and a cancel meant for an engine
        that is gone has nothing left to stop."""
        with self._lock:
            held = self._held.pop(request_id, None)
            if held is not None:
                self._watched.pop(request_id, None)
            child = self._child
        if held is None:
            child.outbox.put(Cancel(request_id, reason))
            return
        message, future = held
        future.set_result(Completion.empty(request_id, len(message.request.prompt_ids), reason))

    def stats(self, timeout: float = 10.0) -> EngineStats:
        """The engine's counters and the loop's gaps, as the child has them now, and the restarts of the child."""
        number = next(self._stats_numbers)
        future: Future[EngineStats] = Future()
        with self._lock:
            if not self.alive or self._restarting:
                raise EngineDead(f"engine process is dead or restarting: {self.error!r}")
            self._stats[number] = future
            child = self._child
        child.outbox.put(StatsQuery(number))
        try:
            return replace(future.result(timeout), restarts=self.restarts)
        finally:
            with self._lock:
                self._stats.pop(number, None)

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.close()
        with self._lock:
            self._lock.wait_for(lambda: not self._restarting, timeout)
            child = self._child
        child.outbox.put(Close())
        child.outbox.close()
        child.process.join(timeout)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout)
        child.reader.join(timeout)
        self._release_held(EngineDead("engine closed"))

    def _spawn(self) -> tuple[Spawned, int]:
        """A new engine process, once it has loaded its engine; and its context length."""
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        process = context.Process(target=serve, args=(self._factory, child_end, logging.getLogger().level,
                                                      self._beat_s), name=self._name, daemon=True)
        process.start()
        child_end.close()
        if not conn.poll(self._start_timeout):
            process.kill()
            raise RuntimeError(f"the engine process did not load its engine within {self._start_timeout:.0f}s")
        try:
            first = conn.recv()[0]
        except EOFError:
            process.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {process.exitcode})") from None
        if isinstance(first, Failed):
            process.join(5)
            raise RuntimeError(f"the engine process could not load its engine:\n{first.traceback}")
        return Spawned(process, conn), first.max_model_len

    def _read_from(self, child: Spawned) -> None:
        child.reader = threading.Thread(target=self._read, args=(child,), name=f"{self._name}-reader", daemon=True)
        child.reader.start()

    def _stalled(self, why: str) -> None:
        """The watchdog's verdict: kill the engine process (what waits on it fails with `EngineStalled`) and
        start a new one; if that fails, the engine is dead."""
        with self._lock:
            if self._closing or self.error is not None:
                return
            self._restarting = True
            child = self._child
        child.stalled = why
        log.error("the engine process %s stalled (%s): killing it and starting a new one", child.process.pid, why)
        child.process.kill()
        # every request of the stalled engine fails before a new one is taken, by its reader once the pipe closes
        # or, should that reader be stuck, here
        child.reader.join(READER_JOIN_S)
        if child.reader.is_alive():
            log.error("the stalled engine's reader did not end within %.0fs; failing its requests without it",
                      READER_JOIN_S)
            self._fail_pending(child)
        child.outbox.close()
        child.conn.close()
        try:
            new, _ = self._spawn()
        except Exception as exc:
            error = EngineDead(f"the engine stalled ({why}) and could not be started again: {exc}")
            with self._lock:
                self.error = error
                self._restarting = False
                self._lock.notify_all()
            self._release_held(error)
            log.critical("%s", error)
            if self.on_death is not None:
                self.on_death(error)
            return
        self._read_from(new)
        self._take_over(new)
        log.warning("a new engine process (%s) took over from the stalled one", new.process.pid)

    def _take_over(self, new: Spawned) -> None:
        """`new` serves from now on, starting with what was submitted while it loaded."""
        with self._lock:
            self._child = new
            self._restarting = False
            self.restarts += 1
            held, self._held = self._held, {}
            self._futures.update((request_id, future) for request_id, (_, future) in held.items())
            self._lock.notify_all()
        for message, _ in held.values():
            new.outbox.put(message)

    def _release_held(self, error: EngineDead) -> None:
        """What waited for a new engine that will not come fails with `error`."""
        with self._lock:
            held, self._held = self._held, {}
            for request_id in held:
                self._watched.pop(request_id, None)
        for _, future in held.values():
            if not future.done():
                future.set_exception(error)

    def _read(self, child: Spawned) -> None:
        handlers: dict[type[Message], Callable] = {Done: self._on_done, Tokens: self._on_tokens,
                                                   StatsReply: self._on_stats, Beat: self._on_beat,
                                                   Dead: partial(self._on_dead, child)}
        try:
            while True:
                for message in child.conn.recv():
                    handlers[type(message)](message)
        except (EOFError, OSError):
            pass
        finally:
            self._fail_pending(child)

    def _on_done(self, message: Done) -> None:
        completion = message.completion
        with self._lock:
            self._watched.pop(completion.request_id, None)
            future = self._futures.pop(completion.request_id, None)
        if future is not None and not future.done():
            future.set_result(completion)

    def _on_tokens(self, message: Tokens) -> None:
        watched = self._watched.get(message.request_id)
        if watched is None:
            return
        on_tokens, tokens = watched
        tokens.extend(message.new_tokens)
        try:
            on_tokens(list(tokens))
        except Exception:  # a progress report is never worth a request
            log.exception("progress callback of %s failed", message.request_id)

    def _on_stats(self, message: StatsReply) -> None:
        with self._lock:
            future = self._stats.pop(message.number, None)
        if future is not None:
            future.set_result(message.stats)

    def _on_beat(self, message: Beat) -> None:
        if self._watchdog is not None:
            self._watchdog.beat(message.turns, message.busy)

    def _on_dead(self, child: Spawned, message: Dead) -> None:
        child.death = f"the engine failed: {message.error}"

    def _fail_pending(self, child: Spawned) -> None:
        """The child is gone: what waits on it fails, with `EngineStalled` if the watchdog killed it (a new one
        is on its way), else with `EngineDead`, and the engine is dead."""
        with self._lock:
            if child.failed:
                return
            child.failed = True
        child.process.join(1)
        code = child.process.exitcode
        if child.stalled is not None:
            error: EngineDead = EngineStalled(f"the engine stalled ({child.stalled}) and was killed")
        else:
            error = EngineDead(child.death if self._closing else f"{child.death} (exit code {code})")
        with self._lock:
            if child.stalled is None:
                self.error = error
            pending = list(self._futures.values()) + list(self._stats.values())
            for request_id in self._futures:  # not those held for the next engine
                self._watched.pop(request_id, None)
            self._futures.clear()
            self._stats.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)
        if child.stalled is None and not self._closing:
            log.critical("%s", error)
            if self.on_death is not None:
                self.on_death(error)
