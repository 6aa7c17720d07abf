"""The engine in a process of its own, behind the same face as `EngineThread`.

A worker runs hundreds of Celery threads, and all their Python (JSON, SQL, Redis, Celery's event loop) shares
one interpreter lock. With the engine as a thread of that process, every step waits for the lock after the
device finished, and on a GPU, where a step takes milliseconds, the device idles for as long. Here the model
and its step loop live in a spawned process (a fresh interpreter: no CUDA context or lock inherited through
`fork`) that runs nothing else; the worker's threads talk to it over a pipe, as vLLM's front end talks to its
engine core.

Inside the child an `EngineThread` runs the loop (so request isolation, deadlines and progress reports are the
same code in both modes), the child's main thread reads the pipe and an `Outbox` thread writes to it. Messages
are plain tuples, pickled by the pipe; the child's go in lists, all that queued up since its last write:

    parent -> child   ("submit", Request, streams)   ("cancel", request id, reason)   ("stats", n)   ("close",)
    child -> parent   ("ready", max_model_len)     ("failed", traceback)             ("done", Completion)
                      ("tokens", request id, new token ids)   ("stats", n, dict)     ("dead", error)

Progress goes over as the tokens added since the last report, so a long output is not sent again and again.
A request's `arrival` and `deadline` are `time.monotonic()` readings, a clock both processes share.

If the child dies (a crash, an out-of-memory kill, a fatal engine error), the parent's reader sees the pipe
close at once: every pending future fails with `EngineDead` and `on_death` is called. The child ignores
SIGINT and SIGTERM, which reach a whole process group: its parent decides when it stops, and it stops by
itself when the parent is gone (the pipe closes).
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
from multiprocessing.connection import Connection

from engine.interface import Completion, Request, StepEngine, TokensCallback
from engine.runtime.engine_thread import EngineDead, EngineThread

log = logging.getLogger(__name__)


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
            [(kind, value)] = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._process.exitcode})"
                               ) from None
        if kind == "failed":
            self._process.join(5)
            raise RuntimeError(f"the engine process could not load its engine:\n{value}")
        self.max_model_len: int = value
        self._send_lock = threading.Lock()  # many Celery threads submit; a pipe write must not interleave
        self._lock = threading.Lock()
        self._futures: dict[str, Future[Completion]] = {}
        self._watched: dict[str, tuple[TokensCallback, list[int]]] = {}  # request id -> (callback, tokens so far)
        self._stats: dict[int, Future[dict[str, float]]] = {}
        self._stats_numbers = itertools.count()
        self._closing = False
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
        self._send(("submit", request, on_tokens is not None))
        return future

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request before its next step; its completion's finish reason is `reason`."""
        self._send(("cancel", request_id, reason))

    def stats(self, timeout: float = 10.0) -> dict[str, float]:
        """The engine's counters and the loop's gaps, as the child has them now."""
        number = next(self._stats_numbers)
        future: Future[dict[str, float]] = Future()
        with self._lock:
            if not self.alive:
                raise EngineDead(f"engine process is dead: {self.error!r}")
            self._stats[number] = future
        self._send(("stats", number))
        return future.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        with contextlib.suppress(EngineDead):  # already gone
            self._send(("close",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        self._reader.join(timeout)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as exc:  # the child is gone; the reader fails what is pending
            raise EngineDead(f"engine process is gone: {exc!r}") from exc

    def _read(self) -> None:
        reason = "the engine process exited"
        try:
            while True:
                for message in self._conn.recv():
                    kind = message[0]
                    if kind == "done":
                        self._resolve(message[1])
                    elif kind == "tokens":
                        self._progress(message[1], message[2])
                    elif kind == "stats":
                        with self._lock:
                            future = self._stats.pop(message[1], None)
                        if future is not None:
                            future.set_result(message[2])
                    elif kind == "dead":
                        reason = f"the engine failed: {message[1]}"
        except (EOFError, OSError):
            pass
        finally:
            self._fail_pending(reason)

    def _resolve(self, completion: Completion) -> None:
        with self._lock:
            self._watched.pop(completion.request_id, None)
            future = self._futures.pop(completion.request_id, None)
        if future is not None and not future.done():
            future.set_result(completion)

    def _progress(self, request_id: str, new_tokens: list[int]) -> None:
        watched = self._watched.get(request_id)
        if watched is None:
            return
        on_tokens, tokens = watched
        tokens.extend(new_tokens)
        try:
            on_tokens(list(tokens))
        except Exception:  # a progress report is never worth a request
            log.exception("progress callback of %s failed", request_id)

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
        conn.send([("failed", traceback.format_exc())])
        return
    outbox = Outbox(conn)
    thread = EngineThread(engine)

    def die(error: BaseException) -> None:
        # the engine thread died: its state is unknown. Say why, and go: the parent sees the pipe close.
        outbox.put(("dead", repr(error)))
        outbox.close()
        os._exit(3)

    def finished(future: Future[Completion]) -> None:
        if future.exception() is None:  # else the engine thread died: `watch` ends this process
            outbox.put(("done", future.result()))

    def watch() -> None:
        thread.join()
        if thread.error is not None:
            die(thread.error)

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    outbox.put(("ready", engine.max_model_len))
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "submit":
                _, request, streams = message
                future = thread.submit(request, _delta_sender(outbox, request.request_id) if streams else None)
                future.add_done_callback(finished)
            elif kind == "cancel":
                thread.cancel(message[1], message[2])
            elif kind == "stats":
                outbox.put(("stats", message[1], thread.stats()))
            elif kind == "close":
                break
    except EOFError:  # the parent is gone
        pass
    except EngineDead as exc:  # a submit after the engine thread died
        die(exc)
    finally:
        thread.close()
        outbox.close()


class Outbox:
    """The child's messages to its parent, sent by a thread of their own: the step loop only queues them, and
    whatever queued up while a message was being sent goes in the next single write. Pickling and writing
    completions and progress then overlap the next step (the forward releases the interpreter lock) instead of
    adding to the gap before it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
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
        outbox.put(("tokens", request_id, tokens[sent:]))
        sent = len(tokens)

    return on_tokens
