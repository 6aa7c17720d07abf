"""Our engine at a set pace, with replies that never stop early at an end-of-text token: a reply takes as long
as a test needs to act on it mid-generation (follow its text, cancel it, let its deadline pass)."""

from __future__ import annotations

import time
from dataclasses import replace

from engine import builder
from engine.core.sequence import Sequence
from engine.interface import Completion, Request
from engine.llm_engine import LLMEngine
from worker.engine_factory import WorkerSettings, engine_options

STEP_S = 0.03


class PacedEngine(LLMEngine):
    def prepare(self, request: Request) -> Sequence:
        request.sampling = replace(request.sampling, ignore_eos=True)  # where every request's sequence is made
        return super().prepare(request)

    def step(self) -> list[Completion]:
        time.sleep(STEP_S)
        return super().step()


def create(model: str, device: str, dtype: str) -> PacedEngine:
    return PacedEngine(builder.engine_config(model, engine_options(WorkerSettings(model=model, device=device, dtype=dtype))))
