"""From a job's payload to the engine and back: owns the backend's engine thread for this worker process.

Many Celery threads call `run()` at once; each blocks on its own futures while the single engine thread
batches everything in flight. A summary of a transcript longer than the model's context becomes several
engine requests (`worker.summarize`).
"""

from __future__ import annotations

import importlib
import time
from concurrent.futures import Future

import torch

from engine.interface import Request, SamplingParams, StepEngine
from engine.runner import Runner
from engine.text import encode_chat
from jobs.settings import Settings
from worker.payload import Outcome, sampling_from
from worker.prompts import chat_for
from worker.summarize import summarize


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_backend(settings: Settings) -> StepEngine:
    device = resolve_device(settings.device)
    if settings.backend == "hf":
        from engine.hf_backend import HFEngine

        return HFEngine(settings.model, device=device, dtype=settings.dtype, max_batch_size=settings.max_batch_size)
    if settings.backend == "engine":
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(
            model=settings.model, device=device, dtype=settings.dtype, kv_cache_memory=settings.kv_cache_memory,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
            kv_cache_dtype=settings.kv_cache_dtype, attention_policy=settings.attention_policy,
            enable_prefix_cache=settings.enable_prefix_cache, host_cache_memory=settings.host_cache_memory,
        ))
    module, _, factory = settings.backend.partition(":")
    return getattr(importlib.import_module(module), factory)(settings.model, device=device, dtype=settings.dtype)


class Bridge:
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine
        self.runner = Runner(engine)

    @classmethod
    def from_settings(cls, settings: Settings) -> Bridge:
        return cls(load_backend(settings))

    @property
    def context(self) -> int:
        return self.engine.max_model_len

    def prompt_ids(self, chat: list[dict]) -> list[int]:
        return encode_chat(self.engine.tokenizer, chat)

    def submit(self, request_id: str, chat: list[dict], sampling: SamplingParams, payload: dict) -> Future:
        return self.runner.submit(Request(
            request_id=request_id,
            prompt_ids=self.prompt_ids(chat),
            sampling=sampling,
            priority=payload["priority"],
            conversation_id=payload.get("conversation_id"),
        ))

    def run(self, job_id: str, payload: dict) -> Outcome:
        if payload["kind"] == "summarize":
            return summarize(self, job_id, payload)
        start = time.monotonic()
        completion = self.submit(job_id, chat_for(payload["kind"], payload["messages"]),
                                 sampling_from(payload), payload).result()
        return Outcome(completion, (time.monotonic() - start) * 1e3)

    def close(self) -> None:
        self.runner.close()
