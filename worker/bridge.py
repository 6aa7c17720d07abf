"""From a job's payload to the engine and back: owns the backend's engine thread for this worker process.

Many Celery threads call `run()` at once; each blocks on its own future while the single engine thread
batches everything in flight.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch

from engine.interface import Completion, Request, SamplingParams, StepEngine
from engine.runner import Runner
from engine.text import encode_chat
from jobs.settings import Settings
from worker.prompts import chat_for


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_backend(settings: Settings) -> StepEngine:
    device = resolve_device(settings.device)
    if settings.backend == "hf":
        from engine.hf_backend import HFEngine

        return HFEngine(settings.model, device=device, dtype=settings.dtype, max_batch_size=settings.max_batch_size)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=settings.model, device=device, dtype=settings.dtype))


@dataclass
class Outcome:
    completion: Completion
    engine_ms: float


class Bridge:
    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine
        self.runner = Runner(engine)

    @classmethod
    def from_settings(cls, settings: Settings) -> Bridge:
        return cls(load_backend(settings))

    def request_for(self, job_id: str, payload: dict) -> Request:
        s = payload.get("sampling", {})
        sampling = SamplingParams(
            max_new_tokens=s.get("max_new_tokens", 256),
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            top_k=s.get("top_k", 0),
            stop=tuple(s.get("stop", ())),
            seed=s.get("seed"),
        )
        prompt = encode_chat(self.engine.tokenizer, chat_for(payload["kind"], payload["messages"]))
        return Request(
            request_id=job_id or str(uuid.uuid4()),
            prompt_ids=prompt,
            sampling=sampling,
            priority=payload["priority"],
            conversation_id=payload.get("conversation_id"),
        )

    def run(self, job_id: str, payload: dict, timeout: float | None = None) -> Outcome:
        request = self.request_for(job_id, payload)
        start = time.monotonic()
        completion = self.runner.submit(request).result(timeout)
        return Outcome(completion, (time.monotonic() - start) * 1e3)

    def close(self) -> None:
        self.runner.close()
