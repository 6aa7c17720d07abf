"""Refusing at the door what the model could never run: a chat prompt plus its output budget over the context.

The API never loads a model, but the tokenizer and config are small: with them a prompt that would fail in
the worker gets a 422 now and is never enqueued. If the model folder is not readable here (a hub id the API
host has not downloaded), the check is skipped and the worker fails such a job with the same reason.
"""

from __future__ import annotations

import logging
import threading

from engine.text import encode_chat
from jobs.schemas import JobIn

log = logging.getLogger(__name__)


class PromptCheck:
    def __init__(self, model: str) -> None:
        self.model = model
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

                self._tokenizer = AutoTokenizer.from_pretrained(self.model)
                self.context = int(AutoConfig.from_pretrained(self.model).max_position_embeddings)
            except Exception as exc:  # not readable from this host: the worker checks instead
                log.warning("prompt length checks are off: cannot load %s here (%s)", self.model, exc)
            self._loaded = True

    def problem(self, job: JobIn) -> tuple[str, str] | None:
        """(field, message) if the job can never run on this model, else None."""
        self.load()
        if self.context is None:
            return None
        max_new = job.sampling.max_new_tokens
        if job.kind == "summarize":
            # map-reduce needs room for at least two partial summaries in one prompt
            if 3 * max_new > self.context:
                return "max_new_tokens", (f"max_new_tokens {max_new} is too large to summarize with this model's "
                                          f"context of {self.context} tokens (at most {self.context // 3})")
            return None
        prompt = len(encode_chat(self._tokenizer, [m.model_dump() for m in job.messages]))
        if prompt + max_new > self.context:
            return "messages", (f"the prompt has {prompt} tokens; with max_new_tokens {max_new} it exceeds the "
                                f"model's context of {self.context} tokens")
        return None
