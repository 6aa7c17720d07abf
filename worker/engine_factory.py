"""The engine a worker runs, built from settings: the one place settings become an `EngineConfig`.

Every backend gets `settings.model` as a local folder (`jobs.model_source`): a hub id is fetched into the
Hugging Face cache here, so the engine and custom backends only ever read folders.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.interface import EngineRunner, StepEngine
from engine.runtime.engine_process import EngineProcess
from engine.runtime.engine_thread import EngineDead, EngineThread
from jobs.model_source import resolve_model
from jobs.settings import Settings


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def engine_config(settings: Settings, **overrides) -> EngineConfig:
    """Our engine's configuration for these settings; `overrides` (EngineConfig fields) win, e.g. in `tune`."""
    values = dict(
        model=str(resolve_model(settings.model)), device=resolve_device(settings.device), dtype=settings.dtype,
        kv_cache_memory=settings.kv_cache_memory, max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens, kv_cache_dtype=settings.kv_cache_dtype,
        attention_policy=settings.attention_policy, enable_prefix_cache=settings.enable_prefix_cache,
        host_cache_memory=settings.host_cache_memory, interactive_priority=settings.interactive_priority,
        interactive_slowdown=settings.interactive_slowdown, interactive_tpot=settings.interactive_tpot_ms / 1e3,
        interactive_ttft=settings.interactive_ttft_ms / 1e3,
    ) | overrides
    # every running sequence must be able to decode in one step
    values["max_num_batched_tokens"] = max(values["max_num_batched_tokens"], values["max_num_seqs"])
    return EngineConfig(**values)


def load_backend(settings: Settings) -> StepEngine:
    """The backend `settings.backend` names: `engine` (ours), `hf` (transformers' generate) or a factory."""
    device = resolve_device(settings.device)
    if settings.backend == "engine":
        from engine.llm_engine import LLMEngine

        return LLMEngine(engine_config(settings))  # resolves the model itself: `tune` builds configs too
    model = str(resolve_model(settings.model))
    if settings.backend == "hf":
        from engine.hf_backend import HFEngine

        return HFEngine(model, device=device, dtype=settings.dtype, max_batch_size=settings.max_batch_size)
    module, _, factory = settings.backend.partition(":")
    return getattr(importlib.import_module(module), factory)(model, device=device, dtype=settings.dtype)


def start_engine(settings: Settings, on_death: Callable[[EngineDead], None] | None = None) -> EngineRunner:
    """The backend behind its step loop: in a process of its own (`CONVOQ_ENGINE_PROCESS`, the default), which
    loads the model while this process keeps only the tokenizer, or in a thread of this process."""
    if not settings.engine_process:
        return EngineThread(load_backend(settings))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings.model, weights=False))
    return EngineProcess(partial(load_backend, settings), tokenizer, on_death=on_death)
