"""What the worker and its engine process say to each other over their pipe, and how each side sends it.

Messages are small dataclasses; each side has one table from message type to handler:

    parent -> child   Submit(request, streams)  Cancel(request_id, reason)  StatsQuery(number)  Close()
    child -> parent   Ready(max_model_len)  Failed(traceback)  Done(completion)  Tokens(request_id, new_tokens)
                      StatsReply(number, stats)  Dead(error)  Beat(turns, busy)

On each side a reader thread takes lists of messages off the pipe and an `Outbox` thread sends what queued
since its last write as one list. `arrival` and `deadline` are `time.monotonic()` readings, a clock both
processes share.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.interface import Completion, EngineStats, FinishReason, Request


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
