"""The worker's side of the engine. Prompts go in and completions come out, through the one loop that owns the
engine (an `EngineRunner`, which is a process of its own or a thread of the worker's).

Many Celery threads run jobs at once; each opens a `JobRun` on the bridge and blocks on its own futures while
the engine loop batches everything in flight. What a job's prompts are (one chat, or the parts of a
map-reduce summary) is decided by the task (`worker.runs`, `worker.reply`, `worker.summarize`), never here.

A run can be stopped from any thread (`Bridge.stop`), by a cancel or by a deadline the reconciler saw. Its
requests in the engine are stopped before the next step and keep their text so far. Requests it submits
afterwards end at once with the same reason. An engine that does not answer a stop within `stop_grace_s` (it is
stuck, and its watchdog has not acted yet) is not waited for. The run's requests end with the reason and the text
the run has seen stream in, and whatever the engine says about them later is dropped. A run past its deadline by
as much is stopped the same way (`expired`), so a stuck engine never holds a cancel or a deadline back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import datetime

from engine.interface import (
    Completion,
    EngineRunner,
    EngineStats,
    FinishReason,
    Request,
    SamplingParams,
    TokensCallback,
    cut_at_stop,
)
from jobs.chat import Chat, encode_chat, thinking_of
from jobs.model_source import resolve_model
from jobs.queues import is_interactive
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import as_utc, utcnow
from jobs.tool_calls import template_tools
from worker.sampling import OURS, sampling_defaults, sampling_params

log = logging.getLogger(__name__)
# how long a stopped run waits for the engine to stop its requests (a healthy engine does before its next step)
STOP_GRACE_S = 3.0


def engine_clock(moment: datetime) -> float:
    """A wall-clock moment on the engine's clock (`time.monotonic`). A job's creation becomes its requests'
    arrival, so that time in the broker counts as waiting (the engine ages waiting requests by it); a creation
    stamped in this host's future counts as now."""
    return time.monotonic() - max(0.0, (utcnow() - as_utc(moment)).total_seconds())


def cache_salt(tenant: str | None) -> str:
    """The engine's cache salt for the jobs of `tenant`: they reuse only prefix-cache blocks that jobs of the same
    tenant computed. Jobs without a tenant (admin keys') share one salt, which no tenant's equals."""
    return "admin" if tenant is None else f"tenant:{tenant}"


def deadline_clock(deadline_at: datetime) -> float:
    """A deadline on the engine's clock; one already past is due now."""
    return time.monotonic() + (as_utc(deadline_at) - utcnow()).total_seconds()


class JobRun:
    """One job's requests on the bridge: they share its sampling, priority, arrival and deadline, and stop
    together."""

    def __init__(self, bridge: Bridge, job_id: str, job: JobIn, created_at: datetime,
                 deadline_at: datetime | None, on_tokens: TokensCallback | None, tenant: str | None) -> None:
        self.bridge = bridge
        self.job_id = job_id
        self.job = job
        self.cache_salt = cache_salt(tenant)
        self.arrival = engine_clock(created_at)
        self.deadline = deadline_clock(deadline_at) if deadline_at is not None else None
        self.on_tokens = on_tokens
        self.thinking = thinking_of(job, bridge.default_thinking)
        self.interactive = is_interactive(job.priority, bridge.settings)
        self.sampling = sampling_params(job, bridge.sampling_defaults, self.thinking)
        self.stopped: FinishReason | None = None  # why it stopped, once it has
        self._give_up_at = float("inf")  # once stopped, when to stop waiting for the engine
        # request id -> (the future handed out, its prompt's length, the tokens seen streaming so far)
        self._pending: dict[str, tuple[Future[Completion], int, list[int]]] = {}
        self._lock = threading.Lock()

    @property
    def max_model_len(self) -> int:
        return self.bridge.max_model_len

    @property
    def tokenizer(self) -> object:
        return self.bridge.tokenizer

    def prompt_ids(self, chat: Chat) -> list[int]:
        return self.bridge.prompt_ids(chat, self.thinking, self.interactive, template_tools(self.job))

    def submit(self, part: str | None, prompt_ids: list[int], stream: bool = False,
               free: bool = False) -> Future[Completion]:
        """Run one prompt of the job: `part` None is the job's only request, else the request `JOB:part`.
        With `stream`, the run's `on_tokens` sees its output as it grows. `free`: the output is not the job's
        answer (a summary's part), so it runs without the answer's grammar and log-probabilities."""
        request_id = self.job_id if part is None else f"{self.job_id}:{part}"
        streamer = self._streamer(request_id) if stream else None
        sampling = replace(self.sampling, grammar=None, grammar_after_think=False, logprobs=None) if free \
            else self.sampling
        return self._submit(request_id, prompt_ids, sampling, streamer)

    def choices(self, prompt_ids: list[int]) -> list[Future[Completion]]:
        """The job's `n` answers to one prompt: choice 0 is the request `JOB` and streams, choice i the request
        `JOB:i`, sampled with seed + i when the job has a seed (so each choice is reproducible). The others go
        in once choice 0's prompt is in the engine's prefix cache (its first tokens came, or it ended), so that
        the prompt is computed once; with no prefix cache to wait for, at once."""
        prefilled = threading.Event()
        first = self._submit(self.job_id, prompt_ids, self.sampling, self._streamer(self.job_id, prefilled))
        if self.job.n > 1 and self.bridge.prefix_cache:
            first.add_done_callback(lambda _: prefilled.set())
            prefilled.wait()
        seed, futures = self.sampling.seed, [first]
        for i in range(1, self.job.n):
            sampling = self.sampling if seed is None else replace(self.sampling, seed=(seed + i) % 2**63)
            futures.append(self._submit(f"{self.job_id}:{i}", prompt_ids, sampling, None))
        return futures

    def _submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                on_tokens: TokensCallback | None) -> Future[Completion]:
        request = Request(request_id=request_id, prompt_ids=prompt_ids, sampling=sampling,
                          priority=self.job.priority, interactive=self.interactive,
                          conversation_id=self.job.conversation_id,
                          arrival=self.arrival, deadline=self.deadline, cache_salt=self.cache_salt)
        future: Future[Completion] = Future()
        with self._lock:
            if self.stopped is not None:
                future.set_result(Completion.empty(request_id, len(prompt_ids), self.stopped))
                return future
            self._pending[request_id] = (future, len(prompt_ids), [])
        try:
            # Not under the lock. A runner's submit may take its time (an engine thread prepares the request on
            # the calling thread), and a stop must not wait with it. An engine process that is restarting holds
            # the request without waiting, and a stop's cancel ends it there.
            engine_future = self.bridge.runner.submit(request, on_tokens)
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            raise
        engine_future.add_done_callback(lambda done: self._settle(request_id, done))
        if self.stopped is not None:  # stopped while it was handed over, so that stop's cancel may have gone first
            self.bridge.runner.cancel(request_id, self.stopped)
        return future

    def stop(self, reason: FinishReason) -> None:
        self._stop(reason, time.monotonic() + self.bridge.stop_grace_s)

    def overdue(self, now: float) -> None:
        """Give up on an engine that has not stopped this run's requests in time (see the module's doc)."""
        if self.stopped is None and self.deadline is not None and now >= self.deadline + self.bridge.stop_grace_s:
            with self._lock:
                late = bool(self._pending)
            if late:
                self._stop(FinishReason.expired, now)
        if now < self._give_up_at:
            return
        with self._lock:
            given_up, self._pending = self._pending, {}
        if given_up:
            log.warning("job %s: the engine did not stop %d requests within %.0fs; ended %s without it",
                        self.job_id, len(given_up), self.bridge.stop_grace_s, self.stopped)
        for request_id, (future, prompt_tokens, tokens) in given_up.items():
            text = cut_at_stop(self.bridge.runner.tokenizer.decode(tokens, skip_special_tokens=True),
                               self.sampling.stop)[0]
            future.set_result(Completion(request_id, tokens, text, prompt_tokens, self.stopped))

    def _stop(self, reason: FinishReason, give_up_at: float) -> None:
        with self._lock:
            if self.stopped is not None:
                return
            self.stopped, self._give_up_at = reason, give_up_at
            in_flight = list(self._pending)
        for request_id in in_flight:
            self.bridge.runner.cancel(request_id, reason)

    def _streamer(self, request_id: str, seen: threading.Event | None = None) -> TokensCallback:
        """The run's `on_tokens`, keeping what streamed in: the text a run the engine never stops ends with.
        `seen` is set once tokens came (called on the engine's thread: nothing that waits may run there)."""

        def on_tokens(tokens: list[int]) -> None:
            with self._lock:
                if (entry := self._pending.get(request_id)) is not None:
                    entry[2][:] = tokens
            if seen is not None:
                seen.set()
            if self.on_tokens is not None:
                self.on_tokens(tokens)

        return on_tokens

    def _settle(self, request_id: str, done: Future[Completion]) -> None:
        with self._lock:
            entry = self._pending.pop(request_id, None)
        if entry is None:  # given up on, so the engine's late word is dropped
            return
        if done.exception() is not None:
            entry[0].set_exception(done.exception())
        else:
            entry[0].set_result(done.result())


class Bridge:
    def __init__(self, runner: EngineRunner, settings: Settings, sampling_defaults: dict[str, float] = OURS,
                 stop_grace_s: float = STOP_GRACE_S) -> None:
        """`settings`: which jobs are interactive, whether chats that do not say reason first;
        `sampling_defaults`: what sampling fields a job leaves unset become (`worker.sampling`); `stop_grace_s`:
        how long a stopped run waits for the engine (see the module's doc)."""
        self.runner = runner
        self.stop_grace_s = stop_grace_s
        self.settings = settings
        self.default_thinking = settings.default_thinking
        self.sampling_defaults = sampling_defaults
        # whether the engine keeps a computed prompt for the next request to reuse (transformers' keeps nothing):
        # then a job's further choices wait for the first's prompt, else they start with it
        self.prefix_cache = settings.backend != "hf" and getattr(settings, "enable_prefix_cache", True)
        # Bulk jobs render and tokenize their prompts one at a time. A batch starts a hundred of them at once,
        # and that much Python at once would starve everything else in this process of the GIL. That is an
        # engine thread here (stalling every step), or the threads that hand interactive work to an engine process.
        # Interactive jobs never wait for this.
        self._bulk_prompts = threading.Lock()
        self._runs: dict[str, JobRun] = {}
        self._runs_lock = threading.Lock()
        self._closed = threading.Event()
        self._overseer = threading.Thread(target=self._oversee, name="bridge-overseer", daemon=True)
        self._overseer.start()

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
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def prompt_ids(self, chat: Chat, thinking: bool, interactive: bool, tools: list[dict] | None = None) -> list[int]:
        """`chat` (a prompt of a job that shows the model `tools`) as token ids."""
        with nullcontext() if interactive else self._bulk_prompts:
            return encode_chat(self.runner.tokenizer, chat, thinking, tools)

    @contextmanager
    def run(self, job_id: str, job: JobIn, created_at: datetime, deadline_at: datetime | None = None,
            on_tokens: TokensCallback | None = None, tenant: str | None = None) -> Iterator[JobRun]:
        """Run `job`, a job of `tenant`, here: its requests count their wait from `created_at`, stop at
        `deadline_at` and share the prefix cache with the tenant's requests only (`cache_salt`)."""
        run = JobRun(self, job_id, job, created_at, deadline_at, on_tokens, tenant)
        with self._runs_lock:
            self._runs[job_id] = run
        try:
            yield run
        finally:
            with self._runs_lock:
                self._runs.pop(job_id, None)
            run.stop(FinishReason.cancelled)  # a run left early (its engine stalled) leaves nothing running in the engine

    def running(self) -> list[str]:
        with self._runs_lock:
            return list(self._runs)

    def stop(self, job_ids: list[str], reason: FinishReason = FinishReason.cancelled) -> list[str]:
        """Stop the runs of these jobs that are here; returns their ids."""
        with self._runs_lock:
            runs = [self._runs[i] for i in job_ids if i in self._runs]
        for run in runs:
            run.stop(reason)
        return [run.job_id for run in runs]

    def stats(self) -> EngineStats:
        return self.runner.stats()

    @property
    def engine_pid(self) -> int | None:
        """The engine's process, when it runs in one of its own (not as a thread of this one)."""
        return getattr(self.runner, "pid", None)

    def close(self) -> None:
        self._closed.set()
        self.runner.close()

    def _oversee(self) -> None:
        """Gives up on stopped runs the engine does not answer (`JobRun.overdue`)."""
        while not self._closed.wait(min(0.5, self.stop_grace_s / 4)):
            now = time.monotonic()
            with self._runs_lock:
                runs = list(self._runs.values())
            for run in runs:
                try:
                    run.overdue(now)
                except Exception:
                    log.exception("checking job %s for a stuck engine failed", run.job_id)
