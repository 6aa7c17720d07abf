"""What running a job gave: the engine's completion (one, or the merge of a map-reduce's), and its cost."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from engine.interface import Completion, FinishReason
from jobs.chat import split_reasoning
from jobs.error_codes import ErrorCode
from jobs.tool_calls import ToolUse, parse
from worker.logprobs import openai_logprobs

# finish reasons of a job stopped before it ended by itself: its text so far is kept as its result. A run stopped
# at shutdown or with its lease lost writes nothing (`worker.runs.judged`).
STOPPED = (FinishReason.cancelled, FinishReason.expired)


@dataclass
class Outcome:
    completion: Completion
    engine_ms: float  # first request submitted -> last completion back
    chunks: int = 1  # transcript chunks summarized (map-reduce)
    levels: int = 1  # summarization levels, the final combine included
    reasoning: str | None = None  # with thinking, the reasoning (the completion's text is then the answer)
    logprobs: list[dict] | None = None  # when asked for, OpenAI's `logprobs.content` of the answer
    tool_calls: list[dict] | None = None  # OpenAI's `tool_calls` the answer made; the completion's text is the rest
    # for a job with `n` > 1, choices 1..n-1 (this outcome is choice 0, and its timings are the job's,
    # `merged_timings`)
    choices: list[Outcome] = field(default_factory=list)
    # a failure found before the engine was asked (`failed`); the engine's own refusals are `invalid_prompt`
    code: ErrorCode | None = None

    @property
    def verdict(self) -> Completion:
        """The completion the job ends as: its first choice that did not finish (failed or stopped; its error
        names the choice), else choice 0."""
        for i, outcome in enumerate([self, *self.choices]):
            c = outcome.completion
            if not c.ok:
                return replace(c, error=f"choice {i}: {c.error}") if i and c.error else c
        return self.completion

    @property
    def completion_tokens(self) -> int:
        """Every token the job generated, all its choices' (what OpenAI's usage counts)."""
        return sum(len(outcome.completion.token_ids) for outcome in [self, *self.choices])

    @classmethod
    def answered(cls, completion: Completion, engine_ms: float, thinking: bool, tokenizer: object | None = None,
                 tools: ToolUse | None = None, **counts: int) -> Outcome:
        """With thinking, the reasoning kept apart from the answer; with `tools`, the calls it made apart from its
        text. `tokenizer` spells the tokens of a completion with logprobs."""
        reasoning, tool_calls = None, None
        logprobs = openai_logprobs(tokenizer, completion, thinking)
        if thinking:
            reasoning, answer = split_reasoning(completion.text)
            completion = replace(completion, text=answer)
        if tools is not None:
            text, tool_calls = parse(completion.text, tools)
            completion = replace(completion, text=text)
        return cls(completion, engine_ms, reasoning=reasoning, logprobs=logprobs, tool_calls=tool_calls, **counts)

    @classmethod
    def failed(cls, request_id: str, error: str, engine_ms: float = 0.0) -> Outcome:
        """A job that cannot run at all (it does not fit the model's context): it fails at once, without a retry,
        `error` telling its tenant why."""
        return cls(Completion.empty(request_id, 0, FinishReason.error, error), engine_ms, code=ErrorCode.too_long)


class Ending(Enum):
    """How a job's run ended, for the task that ran it."""

    FINISHED = "finished"  # with an outcome, which the task stores
    # its worker is shutting down, so the job went back uncharged and its message goes back to the queue
    HANDED_BACK = "handed_back"
    # nothing to store, because the job was failed, retried or given back already, or it had moved on
    SETTLED = "settled"


@dataclass(frozen=True)
class RunEnd:
    """What a job's run leaves its task: how it ended, and the outcome to store when it finished."""

    ending: Ending
    outcome: Outcome | None = None

    @classmethod
    def finished(cls, outcome: Outcome) -> RunEnd:
        return cls(Ending.FINISHED, outcome)
