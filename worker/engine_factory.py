"""The engine a worker runs, built from settings: the one place settings become an `EngineConfig`.

The engine's knobs are declared once, as `EngineConfig` fields; `WorkerSettings` is the service's `Settings` plus
one `CONVOQ_<FIELD>` setting for each of them (every field but `model`, which the service settings name), with
the engine's own defaults and the engine's own checks. Every backend gets `settings.model` as a local folder
(`jobs.model_source`): a hub id is fetched into the Hugging Face cache here, so the engine and custom backends
only ever read folders.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from typing import Any, get_type_hints

from pydantic import create_model, model_validator
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.interface import EngineRunner, StepEngine
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineDead, EngineStalled, EngineThread
from jobs.model_source import resolve_model
from jobs.settings import Settings

ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")


class _CheckedByTheEngine(Settings):
    @model_validator(mode="after")
    def _engine_takes_them(self) -> _CheckedByTheEngine:
        EngineConfig(model="", **engine_options(self))  # raises ValueError naming what it refuses
        return self


def _engine_settings() -> dict[str, Any]:
    hints = get_type_hints(EngineConfig)
    return {f.name: (hints[f.name], f.default) for f in fields(EngineConfig) if f.name != "model"}


# `Settings` plus every engine knob as `CONVOQ_<FIELD>` (what `convoq worker` and `convoq tune` read)
WorkerSettings = create_model("WorkerSettings", __base__=_CheckedByTheEngine, __module__=__name__,
                              **_engine_settings())


def engine_options(settings: Settings) -> dict[str, Any]:
    """The EngineConfig fields `settings` set (a `WorkerSettings` sets them all)."""
    return {name: getattr(settings, name) for name in ENGINE_FIELDS if hasattr(settings, name)}


def engine_config(settings: Settings, **overrides: Any) -> EngineConfig:
    """Our engine's configuration for these settings; `overrides` (EngineConfig fields) win, e.g. in `tune`."""
    return EngineConfig(**{"model": str(resolve_model(settings.model)), **engine_options(settings), **overrides})


def load_backend(settings: Settings) -> StepEngine:
    """The backend `settings.backend` names: `engine` (ours), `hf` (transformers' generate) or a factory."""
    if settings.backend == "engine":
        from engine.llm_engine import LLMEngine

        return LLMEngine(engine_config(settings))  # resolves the model itself: `tune` builds configs too
    config = EngineConfig(model=str(resolve_model(settings.model)), **engine_options(settings))
    if settings.backend == "hf":
        from engine.hf_backend import HFEngine

        return HFEngine(config.model, device=config.device, dtype=config.dtype, max_batch_size=settings.max_batch_size)
    module, _, factory = settings.backend.partition(":")
    return getattr(importlib.import_module(module), factory)(config.model, device=config.device, dtype=config.dtype)


def start_engine(settings: Settings, on_death: Callable[[EngineDead], None] | None = None,
                 on_stall: Callable[[EngineStalled], None] | None = None) -> EngineRunner:
    """The backend behind its step loop: in a process of its own (`CONVOQ_ENGINE_PROCESS`, the default), which
    loads the model while this process keeps only the tokenizer, and is restarted when it stalls
    (`CONVOQ_ENGINE_STALL_S`); or in a thread of this process, whose stall is `on_stall`'s to handle."""
    if not settings.engine_process:
        return EngineThread(load_backend(settings), stall_s=settings.engine_stall_s, on_stall=on_stall)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings.model, weights=False))
    return EngineProcess(partial(load_backend, settings), tokenizer, on_death=on_death,
                         stall_s=settings.engine_stall_s)
