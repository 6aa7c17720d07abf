"""The engine in a process of its own, behind the same face as `EngineThread`.

A worker's Celery threads share one interpreter lock; with the engine among them every step waits for it and
a GPU idles as long. So the model and its loop (an `EngineThread`) live in a spawned process that runs nothing
else; on each side a reader thread takes lists of messages off the pipe and an `Outbox` thread sends what
queued since its last write as one list. Messages are small dataclasses; each side has one table from message
type to handler:

    parent -> child   Submit(request, streams)  Cancel(request_id, reason)  StatsQuery(number)  Close()
    child -> parent   Ready(max_model_len)  Failed(traceback)  Done(completion)  Tokens(request_id, new_tokens)
                      StatsReply(number, stats)  Dead(error)  Beat(turns, busy)

`arrival` and `deadline` are `time.monotonic()` readings, a clock both processes share. When the child dies the
pipe closes and pending futures fail with `EngineDead`. A child that stalls (no beat, or beats with the same
count of loop turns, for `stall_s` while requests wait on it) is killed: its pending futures fail with
`EngineStalled` and a new child takes its place. What is submitted while the new one loads (minutes, for a
large model) waits here and goes in once it is up; a cancel ends such a request at once, so a job's cancel or
deadline never waits for a reload. The child ignores SIGINT and SIGTERM, which reach a whole process group: it
stops when its parent says so or is gone.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
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
from engine.runtime.engine_thread import EngineThread
from engine.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


class Message:
    """What goes over the pipe: one of the dataclasses below."""


@dataclass
class Submit(Message):
    request: Request
    streams: bool  # send its tokens as they come


@dataclass
class Cancel(Message):
    request_id: str
    reason: FinishReason


@dataclass
class StatsQuery(Message):
    number: int  # the reply's `StatsReply.number`


@dataclass
class Close(Message):
    pass


@dataclass
class Ready(Message):
    max_model_len: int


@dataclass
class Failed(Message):
    traceback: str  # the engine could not be built


@dataclass
class Done(Message):
    completion: Completion


@dataclass
class Tokens(Message):
    request_id: str
    new_tokens: list[int]  # added since the request's last report


@dataclass
class StatsReply(Message):
    number: int
    stats: EngineStats


@dataclass
class Dead(Message):
    error: str  # the engine thread died of it


@dataclass
class Beat(Message):
    turns: int  # passes of the engine loop so far (`EngineThread.progress`)
    busy: bool  # it has work


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


def serve(factory: Callable[[], StepEngine], conn: Connection, log_level: int, beat_s: float = 1.0) -> None:
    """The child's main: load the engine, run its loop on an `EngineThread`, beat every `beat_s`, and serve the
    pipe until the parent says close or goes away."""
    for meant_for_the_worker in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):  # its shutdowns end this too
        signal.signal(meant_for_the_worker, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="[%(asctime)s: %(levelname)s/engine-process] %(message)s")
    try:
        engine = factory()
    except BaseException:
        conn.send([Failed(traceback.format_exc())])
        return
    # The model and the libraries live as long as this process: the collector's periodic walks of its oldest
    # generation would stop the step loop for each (370,000 objects, half a second for the tiny model on two
    # cores) and never find garbage there.
    gc.collect()
    gc.freeze()
    child = Child(EngineThread(engine), Outbox(conn))
    threading.Thread(target=child.watch, name="engine-watch", daemon=True).start()
    child.outbox.put(Ready(engine.max_model_len))
    threading.Thread(target=child.beat, args=(beat_s,), name="engine-beat", daemon=True).start()
    try:
        while not child.closing:
            for message in conn.recv():
                child.handlers[type(message)](message)
    except EOFError:  # the parent is gone
        pass
    except EngineDead as exc:  # a submit after the engine thread died
        child.die(exc)
    finally:
        child.grammar_submits.shutdown(wait=False, cancel_futures=True)
        child.thread.close()
        child.outbox.close()


GRAMMAR_SUBMITTERS = 8  # requests with a grammar being submitted at once; each mostly waits on its compile


class Child:
    """The child's side of the pipe: the parent's messages handled, the engine thread's results sent back.

    A request with a grammar is submitted from a thread of `grammar_submits`, not the thread that reads the pipe:
    submitting compiles its grammar (`engine.grammar`, seconds for a large schema), and the submits and cancels
    behind it must not wait for that. One cancelled while it is being submitted ends at once, `cancelled`
    (whatever its compile still does), and is never run."""

    def __init__(self, thread: EngineThread, outbox: Outbox) -> None:
        self.thread = thread
        self.outbox = outbox
        self.closing = False
        self.handlers: dict[type[Message], Callable] = {Submit: self.submit, Cancel: self.cancel,
                                                        StatsQuery: self.stats, Close: self.close}
        self.grammar_submits = ThreadPoolExecutor(GRAMMAR_SUBMITTERS, thread_name_prefix="engine-grammar")
        self._submitting: dict[str, Request] = {}  # requests with a grammar on their way into the engine thread
        self._lock = threading.Lock()

    def submit(self, message: Submit) -> None:
        if message.request.sampling.grammar is None:
            self._submit(message)
            return
        with self._lock:
            self._submitting[message.request.request_id] = message.request
        self.grammar_submits.submit(self._submit_with_grammar, message)

    def _submit(self, message: Submit) -> None:
        request = message.request
        on_tokens = _delta_sender(self.outbox, request.request_id) if message.streams else None
        self.thread.submit(request, on_tokens).add_done_callback(self._finished)

    def _submit_with_grammar(self, message: Submit) -> None:
        request_id = message.request.request_id
        with self._lock:
            if request_id not in self._submitting:  # cancelled while it waited for this thread
                return
        on_tokens = _delta_sender(self.outbox, request_id) if message.streams else None
        try:
            future = self.thread.submit(message.request, on_tokens)  # compiles its grammar
        except EngineDead as exc:
            self.die(exc)
        with self._lock:
            live = self._submitting.pop(request_id, None) is not None
        if live:
            future.add_done_callback(self._finished)
        else:  # cancelled while its grammar compiled: its completion was sent
            self.thread.cancel(request_id)

    def cancel(self, message: Cancel) -> None:
        with self._lock:
            submitting = self._submitting.pop(message.request_id, None)
        if submitting is None:
            self.thread.cancel(message.request_id, message.reason)
        else:
            self.outbox.put(Done(Completion.empty(message.request_id, len(submitting.prompt_ids), message.reason)))

    def stats(self, message: StatsQuery) -> None:
        self.outbox.put(StatsReply(message.number, self.thread.stats()))

    def close(self, message: Close) -> None:
        self.closing = True

    def _finished(self, future: Future[Completion]) -> None:
        if future.exception() is None:  # else the engine thread died: `watch` ends this process
            self.outbox.put(Done(future.result()))

    def beat(self, every_s: float) -> None:
        """Tell the parent how far the engine loop has got, from a thread that is not the loop: a loop stuck in
        a step still beats, with the same count; a frozen process does not beat at all."""
        while True:
            time.sleep(every_s)
            self.outbox.put(Beat(*self.thread.progress()))

    def watch(self) -> None:
        self.thread.join()
        if self.thread.error is not None:
            self.die(self.thread.error)

    def die(self, error: BaseException) -> None:
        """The engine thread died: its state is unknown. Say why, and go: the parent sees the pipe close."""
        self.outbox.put(Dead(repr(error)))
        self.outbox.close()
        os._exit(3)


class Outbox:
    """One side's messages to the other, sent by a thread of their own; whatever queued up while a message was
    being sent goes in the next single write. In the child, the step loop only queues its completions and
    progress, so pickling and writing them overlap the next step (the forward releases the interpreter lock)
    instead of adding to the gap before it; in the parent, no caller ever blocks on a pipe that a frozen child
    has stopped reading (the heartbeat sending a cancel, say)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, message: Message) -> None:
        self._queue.put(message)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and not self._queue.empty():  # one reader: not empty means a get won't wait
                batch.append(self._queue.get())
            closing = batch[-1] is None
            if closing:
                batch.pop()
            if batch:
                with contextlib.suppress(OSError):  # the parent is gone; the main thread sees the pipe close too
                    self._conn.send(batch)
            if closing:
                return


def _delta_sender(outbox: Outbox, request_id: str) -> TokensCallback:
    """An `on_tokens` for the child's engine thread that sends only the tokens added since its last call."""
    sent = 0

    def on_tokens(tokens: list[int]) -> None:
        nonlocal sent
        outbox.put(Tokens(request_id, tokens[sent:]))
        sent = len(tokens)

    return on_tokens
