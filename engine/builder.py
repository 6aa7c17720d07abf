"""An engine from its knobs: knobs -> `EngineConfig` -> backend -> a runner that drives it.

This and `engine.interface` are all a service needs of the engine. The knobs are `EngineConfig`'s fields but
those the service fills in itself (`SERVICE_FIELDS`); the service declares one setting for each knob (`knobs()`)
and hands their values back here, with its own fields'.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

from engine.config import BOUNDS, CHOICES, EngineConfig, field_docs
from engine.interface import EngineDead, EngineRunner, EngineStalled, StepEngine
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineThread

# the model's folder, the service's own bound on log-probabilities (its contract's), and whether requests speculate
# (a setting of the service's own, CONVOQ_SPECULATIVE): not knobs of their own
SERVICE_FIELDS = ("model", "max_logprobs", "speculative")
# a model name -> its local folder; `weights=False` needs only the config and tokenizer files
Resolve = Callable[..., Path | str]


class Knob(NamedTuple):
    """What a service needs to declare a knob as a setting, and to document it."""

    type: Any
    default: Any
    doc: str  # the field's docstring
    bound: dict[str, float]  # ge, gt, le, lt: `engine.config.BOUNDS`
    choices: tuple[str, ...]  # the names it takes, if only a few: `engine.config.CHOICES`


def knobs() -> dict[str, Knob]:
    """Every `EngineConfig` field but `SERVICE_FIELDS`, by name."""
    hints, docs = get_type_hints(EngineConfig), field_docs(EngineConfig)
    return {f.name: Knob(hints[f.name], f.default, docs.get(f.name, ""), BOUNDS.get(f.name, {}), CHOICES.get(f.name, ()))
            for f in fields(EngineConfig) if f.name not in SERVICE_FIELDS}


def check_knobs(values: Mapping[str, Any]) -> None:
    """Raises ValueError naming a value the engine refuses."""
    EngineConfig(model="", **values)


def engine_config(folder: Path | str, values: Mapping[str, Any]) -> EngineConfig:
    return EngineConfig(model=str(folder), **values)


def load_backend(backend: str, folder: Path | str, values: Mapping[str, Any], max_batch_size: int = 16) -> StepEngine:
    """The backend `backend` names for the model in `folder`: `engine` (ours), `hf` (transformers' generate) or
    `module:factory`, called with the folder, `device` and `dtype`."""
    config = engine_config(folder, values)
    if backend == "engine":
        from engine.llm_engine import LLMEngine

        return LLMEngine(config)
    if backend == "hf":
        from engine.hf_backend import HFEngine

        return HFEngine(config.model, device=config.device, dtype=config.dtype, max_batch_size=max_batch_size)
    module, _, factory = backend.partition(":")
    return getattr(importlib.import_module(module), factory)(config.model, device=config.device, dtype=config.dtype)


def _resolve_and_load(backend: str, model: str, values: Mapping[str, Any], max_batch_size: int,
                      resolve: Resolve) -> StepEngine:
    return load_backend(backend, resolve(model), values, max_batch_size)


def start_runner(backend: str, model: str, values: Mapping[str, Any], resolve: Resolve, *, own_process: bool = True,
                 stall_s: float | None = None, max_batch_size: int = 16,
                 on_death: Callable[[EngineDead], None] | None = None,
                 on_stall: Callable[[EngineStalled], None] | None = None) -> EngineRunner:
    """The backend behind its step loop. With `own_process`, in a process of its own, which resolves and loads
    the model while this process keeps only the tokenizer, and is started again when it stalls for `stall_s`
    (`resolve` must then be picklable, a module-level function). Else in a thread of this process, whose stall
    is `on_stall`'s to handle."""
    load = partial(_resolve_and_load, backend, model, dict(values), max_batch_size, resolve)
    if not own_process:
        return EngineThread(load(), stall_s=stall_s, on_stall=on_stall)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve(model, weights=False))
    return EngineProcess(load, tokenizer, on_death=on_death, stall_s=stall_s)
