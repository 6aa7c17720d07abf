"""The engine in a process of its own, behind the same face as `EngineThread`.

A worker's Celery threads share one interpreter lock; with the engine among them every step waits for it and
a GPU idles as long. So the model and its loop (an `EngineThread`) live in a spawned process that runs nothing
else; its main thread reads the pipe, an `Outbox` thread sends what queued since its last write as one list.
Messages are small dataclasses; each side has one table from message type to handler:

    parent -> child   Submit(request, streams)  Cancel(request_id, reason)  StatsQuery(number)  Close()
    child -> parent   Ready(max_model_len)  Failed(traceback)  Done(completion)  Tokens(request_id, new_tokens)
                      StatsReply(number, stats)  Dead(error)

`arrival` and `deadline` are `time.monotonic()` readings, a clock both processes share. When the child dies the
pipe closes and pending futures fail with `EngineDead`. The child ignores SIGINT and SIGTERM, which reach a whole
process group: it stops when its parent says so or is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.interface import Completion, Request, StepEngine, TokensCallback
from engine.runtime.engine_thread import EngineDead, EngineThread

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
    reason: str


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
    stats: dict[str, float]


@dataclass
class Dead(Message):
    error: str  # the engine thread died of it


class EngineProcess:
    def __init__(self, factory: Callable[[], StepEngine], tokenizer: object, name: str = "engine",
                 on_death: Callable[[EngineDead], None] | None = None, start_timeout: float = 1800.0) -> None:
        """Spawn a process that builds its engine with `factory` (picklable: a module-level function or a
        `functools.partial` of one) and runs it. `tokenizer` is this side's copy, for rendering prompts and
        reading progress. Blocks until the engine is loaded."""
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=serve, args=(factory, child_end, logging.getLogger().level),
                                        name=name, daemon=True)
        self._process.start()
        child_end.close()
        self.tokenizer = tokenizer
        self.on_death = on_death
        self.error: BaseException | None = None
        if not self._conn.poll(start_timeout):
            self._process.kill()
            raise RuntimeError(f"the engine process did not load its engine within {start_timeout:.0f}s")
        try:
            [first] = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._process.exitcode})"
                               ) from None
        if isinstance(first, Failed):
            self._process.join(5)
            raise RuntimeError(f"the engine process could not load its engine:\n{first.traceback}")
        self.max_model_len: int = first.max_model_len
        self._send_lock = threading.Lock()  # many Celery threads submit; a pipe write must not interleave
        self._lock = threading.Lock()
        self._futures: dict[str, Future[Completion]] = {}
        self._watched: dict[str, tuple[TokensCallback, list[int]]] = {}  # request id -> (callback, tokens so far)
        self._stats: dict[int, Future[dict[str, float]]] = {}
        self._stats_numbers = itertools.count()
        self._closing = False
        self._death = "the engine process exited"  # why the pipe closed, as far as the child said
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and self.error is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(self, request: Request, on_tokens: TokensCallback | None = None) -> Future[Completion]:
        future: Future[Completion] = Future()
        with self._lock:
            if not self.alive:
                raise EngineDead(f"engine process is dead: {self.error!r}")
            self._futures[request.request_id] = future
            if on_tokens is not None:
                self._watched[request.request_id] = (on_tokens, [])
        self._send(Submit(request, on_tokens is not None))
        return future

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request before its next step; its completion's finish reason is `reason`."""
        self._send(Cancel(request_id, reason))

    def stats(self, timeout: float = 10.0) -> dict[str, float]:
        """The engine's counters and the loop's gaps, as the child has them now."""
        number = next(self._stats_numbers)
        future: Future[dict[str, float]] = Future()
        with self._lock:
            if not self.alive:
                raise EngineDead(f"engine process is dead: {self.error!r}")
            self._stats[number] = future
        self._send(StatsQuery(number))
        return future.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        with contextlib.suppress(EngineDead):  # already gone
            self._send(Close())
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        self._reader.join(timeout)

    def _send(self, message: Message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as exc:  # the child is gone; the reader fails what is pending
            raise EngineDead(f"engine process is gone: {exc!r}") from exc

    def _read(self) -> None:
        handlers: dict[type[Message], Callable] = {Done: self._on_done, Tokens: self._on_tokens,
                                                   StatsReply: self._on_stats, Dead: self._on_dead}
        try:
            while True:
                for message in self._conn.recv():
                    handlers[type(message)](message)
        except (EOFError, OSError):
            pass
        finally:
            self._fail_pending(self._death)

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

    def _on_dead(self, message: Dead) -> None:
        self._death = f"the engine failed: {message.error}"

    def _fail_pending(self, reason: str) -> None:
        self._process.join(1)
        code = self._process.exitcode
        error = EngineDead(reason if self._closing else f"{reason} (exit code {code})")
        with self._lock:
            self.error = error
            pending = list(self._futures.values()) + list(self._stats.values())
            self._futures.clear()
            self._watched.clear()
            self._stats.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)
        if not self._closing:
            log.critical("%s", error)
            if self.on_death is not None:
                self.on_death(error)


def serve(factory: Callable[[], StepEngine], conn: Connection, log_level: int) -> None:
    """The child's main: load the engine, run its loop on an `EngineThread`, and serve the pipe until the parent
    says close or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="[%(asctime)s: %(levelname)s/engine-process] %(message)s")
    try:
        engine = factory()
    except BaseException:
        conn.send([Failed(traceback.format_exc())])
        return
    child = Child(EngineThread(engine), Outbox(conn))
    threading.Thread(target=child.watch, name="engine-watch", daemon=True).start()
    child.outbox.put(Ready(engine.max_model_len))
    try:
        while not child.closing:
            message = conn.recv()
            child.handlers[type(message)](message)
    except EOFError:  # the parent is gone
        pass
    except EngineDead as exc:  # a submit after the engine thread died
        child.die(exc)
    finally:
        child.thread.close()
        child.outbox.close()


class Child:
    """The child's side of the pipe: the parent's messages handled, the engine thread's results sent back."""

    def __init__(self, thread: EngineThread, outbox: Outbox) -> None:
        self.thread = thread
        self.outbox = outbox
        self.closing = False
        self.handlers: dict[type[Message], Callable] = {Submit: self.submit, Cancel: self.cancel,
                                                        StatsQuery: self.stats, Close: self.close}

    def submit(self, message: Submit) -> None:
        request = message.request
        on_tokens = _delta_sender(self.outbox, request.request_id) if message.streams else None
        self.thread.submit(request, on_tokens).add_done_callback(self._finished)

    def cancel(self, message: Cancel) -> None:
        self.thread.cancel(message.request_id, message.reason)

    def stats(self, message: StatsQuery) -> None:
        self.outbox.put(StatsReply(message.number, self.thread.stats()))

    def close(self, message: Close) -> None:
        self.closing = True

    def _finished(self, future: Future[Completion]) -> None:
        if future.exception() is None:  # else the engine thread died: `watch` ends this process
            self.outbox.put(Done(future.result()))

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
    """The child's messages to its parent, sent by a thread of their own: the step loop only queues them, and
    whatever queued up while a message was being sent goes in the next single write. Pickling and writing
    completions and progress then overlap the next step (the forward releases the interpreter lock) instead of
    adding to the gap before it."""

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
