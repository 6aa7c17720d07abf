"""Refusing at the door what the model could never run (`jobs.chat.problem`).

The API never loads a model, but the tokenizer and config are small: with them a prompt that would fail in
the worker gets a 422 now and is never enqueued. A hub id is fetched into the Hugging Face cache without its
weights (`jobs.model_source`). If the model cannot be had here (offline, and not in this host's cache), the
check is skipped and the worker fails such a job with the same reason.
"""

from __future__ import annotations

import logging
import threading

from jobs.chat import problem
from jobs.model_source import resolve_model
from jobs.schemas import JobIn

log = logging.getLogger(__name__)


class PromptCheck:
    def __init__(self, model: str, default_thinking: bool = False) -> None:
        self.model = model
        self.default_thinking = default_thinking  # the prompt of a chat that thinks is a few tokens shorter
        self._lock = threading.Lock()
        self._loaded = False
        self._tokenizer = None
        self.context: int | None = None

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            try:
                from transformers import AutoConfig, AutoTokenizer

                folder = resolve_model(self.model, weights=False)
                self._tokenizer = AutoTokenizer.from_pretrained(folder)
                self.context = int(AutoConfig.from_pretrained(folder).max_position_embeddings)
            except Exception as exc:  # not readable from this host: the worker checks instead
                log.warning("prompt length checks are off: cannot load %s here (%s)", self.model, exc)
            self._loaded = True

    def problem(self, job: JobIn) -> tuple[str, str] | None:
        """(field, message) if the job can never run on this model, else None."""
        self.load()
        if self.context is None:
            return None
        return problem(job, self._tokenizer, self.context, self.default_thinking)
