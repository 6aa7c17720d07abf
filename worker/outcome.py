"""What running a job gave: the engine's completion (one, or the merge of a map-reduce's), and its cost."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.interface import Completion
from jobs.chat import split_reasoning

# finish reasons of a job stopped before it ended by itself: its text so far is kept as its result
STOPPED = ("cancelled", "expired")
# a run stopped because its worker lost the job's lease: it writes nothing of what it did (`results.give_back`)
LEASE_LOST = "lease_lost"
# a run stopped because its worker is shutting down: its job goes back to the queue uncharged (`worker.shutdown`)
SHUTDOWN = "shutdown"


@dataclass
class Outcome:
    completion: Completion
    engine_ms: float  # first request submitted -> last completion back
    chunks: int = 1  # transcript chunks summarized (map-reduce)
    levels: int = 1  # summarization levels, the final combine included
    reasoning: str | None = None  # with thinking: the reasoning; the completion's text is then the answer

    @classmethod
    def answered(cls, completion: Completion, engine_ms: float, thinking: bool, **counts: int) -> Outcome:
        """With thinking, the reasoning kept apart from the answer."""
        reasoning = None
        if thinking:
            reasoning, answer = split_reasoning(completion.text)
            completion = replace(completion, text=answer)
        return cls(completion, engine_ms, reasoning=reasoning, **counts)

    @classmethod
    def failed(cls, request_id: str, error: str, engine_ms: float = 0.0) -> Outcome:
        """A job that cannot run at all (it does not fit the model): it fails at once, without a retry."""
        return cls(Completion.empty(request_id, 0, "error", error), engine_ms)
