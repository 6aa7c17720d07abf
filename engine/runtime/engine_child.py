"""The spawned engine process's side: it loads the engine, runs its loop on an `EngineThread` and serves the
pipe (`engine.runtime.pipe_protocol`).

It ignores SIGINT and SIGTERM, which reach a whole process group: it stops when its parent says so or is gone.
When the engine thread dies the process says why and exits, and the parent sees the pipe close.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

from engine.interface import Completion, EngineDead, Request, StepEngine, TokensCallback
from engine.runtime.engine_thread import EngineThread
from engine.runtime.pipe_protocol import (
    Beat,
    Cancel,
    Close,
    Dead,
    Done,
    Failed,
    Message,
    Outbox,
    Ready,
    StatsQuery,
    StatsReply,
    Submit,
    Tokens,
)


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


def _delta_sender(outbox: Outbox, request_id: str) -> TokensCallback:
    """An `on_tokens` for the child's engine thread that sends only the tokens added since its last call."""
    sent = 0

    def on_tokens(tokens: list[int]) -> None:
        nonlocal sent
        outbox.put(Tokens(request_id, tokens[sent:]))
        sent = len(tokens)

    return on_tokens
