"""The engine a worker runs, built from settings: the one place settings become the engine's knobs.

The engine's knobs are declared once, as `EngineConfig` fields (`engine.builder.knobs`); `WorkerSettings` is the
service's `Settings` plus one `CONVOQ_<FIELD>` setting for each of them (every field but `model`, which the service
settings name), with the engine's own defaults and the engine's own checks. Every backend gets `settings.model` as a local folder
(`jobs.model_source`): a hub id is fetched into the Hugging Face cache here, so the engine and custom backends
only ever read folders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, create_model, model_validator

from engine import builder
from engine.interface import EngineDead, EngineRunner, EngineStalled, StepEngine
from jobs.model_source import resolve_model
from jobs.schemas import MAX_TOP_LOGPROBS
from jobs.settings import Settings

ENGINE_FIELDS = tuple(builder.knobs())


class _CheckedByTheEngine(Settings):
    @model_validator(mode="after")
    def _engine_takes_them(self) -> _CheckedByTheEngine:
        builder.check_knobs(engine_options(self))  # raises ValueError naming what it refuses
        return self


# `Settings` plus every engine knob as `CONVOQ_<FIELD>` (what `convoq worker` and `convoq tune` read), each described
# by its docstring in `engine.config`; the bounds are the engine's to check
WorkerSettings = create_model("WorkerSettings", __base__=_CheckedByTheEngine, __module__=__name__,
                              **{name: (knob.type, Field(knob.default, description=knob.doc))
                                 for name, knob in builder.knobs().items()})


def engine_options(settings: Settings) -> dict[str, Any]:
    """What the worker gives the engine's config: the knobs `settings` set (a `WorkerSettings` sets them all),
    the contract's bound on the log-probabilities a job may ask for, and whether requests speculate."""
    knobs = {name: getattr(settings, name) for name in ENGINE_FIELDS if hasattr(settings, name)}
    return {**knobs, "max_logprobs": MAX_TOP_LOGPROBS, "speculative": settings.speculative}


def load_backend(settings: Settings) -> StepEngine:
    """The backend `settings.backend` names: `engine` (ours), `hf` (transformers' generate) or a factory."""
    return builder.load_backend(settings.backend, resolve_model(settings.model), engine_options(settings),
                                settings.max_batch_size)


def start_engine(settings: Settings, on_death: Callable[[EngineDead], None] | None = None,
                 on_stall: Callable[[EngineStalled], None] | None = None) -> EngineRunner:
    """The backend behind its step loop: in a process of its own (`CONVOQ_ENGINE_PROCESS`, the default), which
    loads the model while this process keeps only the tokenizer, and is restarted when it stalls
    (`CONVOQ_ENGINE_STALL_S`); or in a thread of this process, whose stall is `on_stall`'s to handle."""
    return builder.start_runner(settings.backend, settings.model, engine_options(settings),
                                resolve_model, own_process=settings.engine_process, stall_s=settings.engine_stall_s,
                                max_batch_size=settings.max_batch_size, on_death=on_death, on_stall=on_stall)
