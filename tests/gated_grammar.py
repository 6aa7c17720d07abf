"""An engine whose grammars wait, before they compile, until the file their schema's `title` names after `gate:`
exists (at most a minute): a compile as long as a test wants, in the engine's own process."""

from __future__ import annotations

import json
import time
from pathlib import Path

from engine import grammar
from engine.interface import GrammarSpec, StepEngine
from worker.engine_factory import WorkerSettings, load_backend

GATE = "gate:"


def gated(compile_spec):
    def wait_then_compile(spec: GrammarSpec):
        title = str(json.loads(spec.schema).get("title", ""))
        if title.startswith(GATE):
            gate, deadline = Path(title.removeprefix(GATE)), time.monotonic() + 60
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return compile_spec(spec)

    return wait_then_compile


def create(model: str) -> StepEngine:
    grammar.grammar_of = gated(grammar.grammar_of)  # this process's grammars: the engine process's own
    return load_backend(WorkerSettings(model=model, device="cpu", kv_cache_memory=2**24))
