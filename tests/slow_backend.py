"""A backend whose bulk requests take ten minutes and interactive ones a moment, with no model at all: with it,
bulk jobs hold their worker threads for as long as a test needs."""

from __future__ import annotations

import time

from transformers import AutoConfig, AutoTokenizer

from engine.interface import Completion, EngineStats, Request, Timings


class SlowBulkEngine:
    def __init__(self, model: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.max_model_len = int(AutoConfig.from_pretrained(model).max_position_embeddings)
        self.due: dict[str, tuple[float, Request]] = {}

    def add_request(self, request: Request) -> None:
        self.due[request.request_id] = (time.monotonic() + (0.05 if request.priority >= 7 else 600), request)

    def abort_request(self, request_id: str) -> Completion | None:
        return None if self.due.pop(request_id, None) is None else Completion(request_id, [], "", 0, "cancelled")

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        return None

    def has_unfinished(self) -> bool:
        return bool(self.due)

    def step(self) -> list[Completion]:
        time.sleep(0.01)
        now = time.monotonic()
        done = [r for at, r in self.due.values() if at <= now]
        for r in done:
            del self.due[r.request_id]
        return [Completion(r.request_id, [5], "done", len(r.prompt_ids), "length", None, Timings()) for r in done]

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.due))


def create(model: str, device: str, dtype: str) -> SlowBulkEngine:
    return SlowBulkEngine(model)
