"""Backends for fault tests: transformers' generate, except that some prompts make a batch fail.

The worker loads it through the `package.module:factory` form of CONVOQ_BACKEND, the way a deployment
would plug in a backend of its own.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from engine.hf_backend import HFEngine
from engine.interface import Request


class PoisonEngine(HFEngine):
    def _take_batch(self) -> list[Request]:
        batch = super()._take_batch()
        if any("POISON" in self.tokenizer.decode(r.prompt_ids) for r in batch):
            raise ValueError("poisoned input crashed the batch")
        return batch


def create(model: str, device: str, dtype: str) -> PoisonEngine:
    return PoisonEngine(model, device=device, dtype=dtype, max_batch_size=8)


class OutOfMemoryEngine(HFEngine):
    """Runs out of device memory on any batch holding an OOM prompt: the engine's state is then unknown."""

    def _take_batch(self) -> list[Request]:
        batch = super()._take_batch()
        if any("OOM" in self.tokenizer.decode(r.prompt_ids) for r in batch):
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return batch


def create_oom(model: str, device: str, dtype: str) -> OutOfMemoryEngine:
    return OutOfMemoryEngine(model, device=device, dtype=dtype, max_batch_size=8)


class CrashingEngine(HFEngine):
    """Kills its own process, as a segfault or a fatal device error would, on any batch holding a CRASH prompt."""

    def _take_batch(self) -> list[Request]:
        batch = super()._take_batch()
        if any("CRASH" in self.tokenizer.decode(r.prompt_ids) for r in batch):
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def create_crash(model: str, device: str, dtype: str) -> CrashingEngine:
    return CrashingEngine(model, device=device, dtype=dtype, max_batch_size=8)


class HangingEngine(HFEngine):
    """Never finishes a batch holding a HANG prompt, as a device call that never returns would."""

    def _take_batch(self) -> list[Request]:
        batch = super()._take_batch()
        if any("HANG" in self.tokenizer.decode(r.prompt_ids) for r in batch):
            threading.Event().wait()
        return batch


def create_hang(model: str, device: str, dtype: str) -> HangingEngine:
    return HangingEngine(model, device=device, dtype=dtype, max_batch_size=8)
