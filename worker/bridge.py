"""The worker's side of the engine: prompts in, completions out, through the one thread that owns the engine.

Many Celery threads call `submit()` at once; each blocks on its own futures while the engine thread batches
everything in flight. What a job's prompts are (one chat, or the parts of a map-reduce summary) is decided
by the task (`worker.tasks`, `worker.summarize`), never here.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from datetime import datetime

from engine.engine_thread import EngineThread
from engine.interface import Completion, Request, SamplingParams, StepEngine
from jobs.chat import Chat, encode_chat
from jobs.schemas import JobIn, Sampling
from jobs.tables import as_utc, utcnow


def engine_clock(created_at: datetime) -> float:
    """A job's creation on the engine's clock (`time.monotonic`), so that time in the broker counts as waiting
    (the engine ages waiting requests by it). A creation stamped in this host's future counts as now."""
    return time.monotonic() - max(0.0, (utcnow() - as_utc(created_at)).total_seconds())


def sampling_params(sampling: Sampling) -> SamplingParams:
    return SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k, stop=tuple(sampling.stop), seed=sampling.seed)


class Bridge:
    def __init__(self, engine: StepEngine, interactive_priority: int) -> None:
        self.engine = engine
        self.thread = EngineThread(engine)
        self.interactive_priority = interactive_priority
        # Bulk jobs render and tokenize their prompts one at a time. A batch starts a hundred of them at once,
        # and that much Python in other threads would starve the engine thread of the GIL, stalling every step
        # (and the interactive requests in it); interactive jobs never wait for this.
        self._bulk_prompts = threading.Lock()

    @property
    def context(self) -> int:
        return self.engine.max_model_len

    def prompt_ids(self, chat: Chat, job: JobIn) -> list[int]:
        """`chat` (a prompt of `job`) as token ids."""
        with nullcontext() if job.priority >= self.interactive_priority else self._bulk_prompts:
            return encode_chat(self.engine.tokenizer, chat)

    def submit(self, request_id: str, prompt_ids: list[int], job: JobIn, created_at: datetime) -> Future[Completion]:
        """Run one prompt of `job` (with its sampling, priority and conversation) in the engine; the engine counts
        its wait from `created_at`, the job's creation."""
        return self.thread.submit(Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling_params(job.sampling),
            priority=job.priority,
            conversation_id=job.conversation_id,
            arrival=engine_clock(created_at),
        ))

    def stats(self) -> dict[str, float]:
        return self.thread.stats()

    def close(self) -> None:
        self.thread.close()
