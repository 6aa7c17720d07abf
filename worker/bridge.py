"""The worker's side of the engine: prompts in, completions out, through the one loop that owns the engine (an
`EngineRunner`: a process of its own, or a thread of the worker's).

Many Celery threads run jobs at once; each opens a `JobRun` on the bridge and blocks on its own futures while
the engine loop batches everything in flight. What a job's prompts are (one chat, or the parts of a
map-reduce summary) is decided by the task (`worker.tasks`, `worker.summarize`), never here.

A run can be stopped from any thread (`Bridge.stop`: a cancel, or a deadline seen by the reconciler): its
requests in the engine are stopped before the next step and keep their text so far; requests it submits
afterwards end at once with the same reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from datetime import datetime

from engine.interface import Completion, EngineRunner, Request, TokensCallback
from jobs.chat import Chat, encode_chat, thinking_of
from jobs.model_source import resolve_model
from jobs.queues import is_interactive
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import as_utc, utcnow
from worker.sampling import OURS, sampling_defaults, sampling_params


def engine_clock(moment: datetime) -> float:
    """A wall-clock moment on the engine's clock (`time.monotonic`). A job's creation becomes its requests'
    arrival, so that time in the broker counts as waiting (the engine ages waiting requests by it); a creation
    stamped in this host's future counts as now."""
    return time.monotonic() - max(0.0, (utcnow() - as_utc(moment)).total_seconds())


def deadline_clock(deadline_at: datetime) -> float:
    """A deadline on the engine's clock; one already past is due now."""
    return time.monotonic() + (as_utc(deadline_at) - utcnow()).total_seconds()


class JobRun:
    """One job's requests on the bridge: they share its sampling, priority, arrival and deadline, and stop
    together."""

    def __init__(self, bridge: Bridge, job_id: str, job: JobIn, created_at: datetime,
                 deadline_at: datetime | None, on_tokens: TokensCallback | None) -> None:
        self.bridge = bridge
        self.job_id = job_id
        self.job = job
        self.arrival = engine_clock(created_at)
        self.deadline = deadline_clock(deadline_at) if deadline_at is not None else None
        self.on_tokens = on_tokens
        self.thinking = thinking_of(job, bridge.default_thinking)
        self.interactive = is_interactive(job.priority, bridge.settings)
        self.sampling = sampling_params(job, bridge.sampling_defaults)
        self.stopped: str | None = None  # "cancelled" or "expired" once stopped
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()

    @property
    def context(self) -> int:
        return self.bridge.context

    def prompt_ids(self, chat: Chat) -> list[int]:
        return self.bridge.prompt_ids(chat, self.thinking, self.interactive)

    def submit(self, part: str | None, prompt_ids: list[int], stream: bool = False) -> Future[Completion]:
        """Run one prompt of the job: `part` None is the job's only request, else the request `JOB:part`.
        With `stream`, the run's `on_tokens` sees its output as it grows."""
        request_id = self.job_id if part is None else f"{self.job_id}:{part}"
        request = Request(request_id=request_id, prompt_ids=prompt_ids, sampling=self.sampling,
                          priority=self.job.priority, interactive=self.interactive,
                          conversation_id=self.job.conversation_id,
                          arrival=self.arrival, deadline=self.deadline)
        with self._lock:  # held while handing over, so that a stop never misses a request on its way in
            if self.stopped is not None:
                future: Future[Completion] = Future()
                future.set_result(Completion.empty(request_id, len(prompt_ids), self.stopped))
                return future
            self._in_flight.add(request_id)
            future = self.bridge.runner.submit(request, self.on_tokens if stream else None)
        future.add_done_callback(lambda _: self._done(request_id))
        return future

    def stop(self, reason: str) -> None:
        with self._lock:
            if self.stopped is not None:
                return
            self.stopped = reason
            in_flight = list(self._in_flight)
        for request_id in in_flight:
            self.bridge.runner.cancel(request_id, reason)

    def _done(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.discard(request_id)


class Bridge:
    def __init__(self, runner: EngineRunner, settings: Settings, sampling_defaults: dict[str, float] = OURS) -> None:
        """`settings`: which jobs are interactive, whether chats that do not say reason first;
        `sampling_defaults`: what sampling fields a job leaves unset become (`worker.sampling`)."""
        self.runner = runner
        self.settings = settings
        self.default_thinking = settings.default_thinking
        self.sampling_defaults = sampling_defaults
        # Bulk jobs render and tokenize their prompts one at a time. A batch starts a hundred of them at once,
        # and that much Python at once would starve everything else in this process of the GIL: an engine
        # thread here (stalling every step), or the threads that hand interactive work to an engine process.
        # Interactive jobs never wait for this.
        self._bulk_prompts = threading.Lock()
        self._runs: dict[str, JobRun] = {}
        self._runs_lock = threading.Lock()

    @classmethod
    def for_settings(cls, runner: EngineRunner, settings: Settings) -> Bridge:
        """The bridge a worker runs jobs through: the settings' thinking default, and the sampling defaults of
        CONVOQ_GENERATION_CONFIG for the model it serves."""
        defaults = sampling_defaults(resolve_model(settings.model, weights=False), settings.generation_config)
        return cls(runner, settings, defaults)

    @property
    def tokenizer(self) -> object:
        return self.runner.tokenizer

    @property
    def context(self) -> int:
        return self.runner.max_model_len

    def prompt_ids(self, chat: Chat, thinking: bool, interactive: bool) -> list[int]:
        """`chat` (a prompt of a job) as token ids."""
        with nullcontext() if interactive else self._bulk_prompts:
            return encode_chat(self.runner.tokenizer, chat, thinking)

    @contextmanager
    def run(self, job_id: str, job: JobIn, created_at: datetime, deadline_at: datetime | None = None,
            on_tokens: TokensCallback | None = None) -> Iterator[JobRun]:
        """Run `job` here: its requests count their wait from `created_at` and stop at `deadline_at`."""
        run = JobRun(self, job_id, job, created_at, deadline_at, on_tokens)
        with self._runs_lock:
            self._runs[job_id] = run
        try:
            yield run
        finally:
            with self._runs_lock:
                self._runs.pop(job_id, None)

    def running(self) -> list[str]:
        with self._runs_lock:
            return list(self._runs)

    def stop(self, job_ids: list[str], reason: str = "cancelled") -> list[str]:
        """Stop the runs of these jobs that are here; returns their ids."""
        with self._runs_lock:
            runs = [self._runs[i] for i in job_ids if i in self._runs]
        for run in runs:
            run.stop(reason)
        return [run.job_id for run in runs]

    def stats(self) -> dict[str, float]:
        return self.runner.stats()

    def close(self) -> None:
        self.runner.close()
