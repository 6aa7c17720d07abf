"""What a backend takes in and gives back: the contract between the worker and any engine.

Both backends (the `hf` reference and our own `LLMEngine`) implement `StepEngine`. An `EngineRunner` drives one
from a loop of its own and hands out futures: `engine.runtime.engine_thread.EngineThread` (a thread of this process)
or `engine.runtime.engine_process.EngineProcess` (a process of its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Protocol

# A temperature below this samples as its limit, greedy (vLLM draws the same line): logits divided by a smaller
# one overflow fp32 to inf, and their softmax is NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    repetition_penalty: float = 1.0  # as transformers: logits of tokens in the prompt or output / (or *) it
    presence_penalty: float = 0.0  # as OpenAI: subtracted from the logits of tokens already in the output
    stop: tuple[str, ...] = ()
    # a thinking model's reasoning budget: past it, `</think>` is forced and the model goes on to answer
    max_thinking_tokens: int | None = None
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks generate exactly max_new_tokens
    # the output is constrained by this grammar (`GrammarSpec`: a JSON schema, or tool calls), compiled on the
    # submitting thread; None: free text
    grammar: GrammarSpec | None = None
    # with a grammar: the model reasons first, free, and the grammar starts after its `</think>`
    grammar_after_think: bool = False
    # None: no log-probabilities; k (0..`EngineConfig.max_logprobs`): each output token's own and its k most
    # likely alternatives'
    logprobs: int | None = None
    # "ngram": its decoding steps may carry draft tokens that one forward verifies (the output is the same);
    # "off": never; None: as the engine's `speculative` setting says
    speculative: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


# an output token's log-probability and its most likely alternatives (token id, log-probability), best first;
# computed from the logits the token was drawn from, after penalties and the grammar's mask, before temperature
TokenLogprobs = tuple[float, list[tuple[int, float]]]

TokensCallback = Callable[[list[int]], None]  # handed a request's output so far as it grows


def fits(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> bool:
    """Whether a request fits the model's context: its prompt and all of its output together (the rule the
    service checks prompts by, `jobs.chat.chat_problem`)."""
    return prompt_tokens + max_new_tokens <= max_model_len


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # 0..9, 9 is the most urgent
    # a person waits on its tokens: the engine keeps it within latency targets and lets it pre-empt bulk work
    # (the service decides which requests are, `jobs.queues.is_interactive`)
    interactive: bool = False
    conversation_id: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    # on the same clock as `arrival`: unfinished by then, the request is stopped (`expired`, its text kept);
    # among waiting requests of one priority, earlier deadlines are admitted first
    deadline: float | None = None
    # opaque to the engine: requests share prefix-cache blocks (and are told of them, in `Timings`) only with
    # requests of an equal salt, str and its UTF-8 bytes alike; None is a salt of its own
    cache_salt: bytes | str | None = None


@dataclass
class Timings:
    """Milliseconds, measured by the engine thread; `arrival` of the request is time zero."""

    queue_wait_ms: float = 0.0  # arrival -> first scheduled
    ttft_ms: float = 0.0  # arrival -> first generated token
    prefill_ms: float = 0.0  # time spent in steps that prefilled this request
    decode_ms: float = 0.0  # first token -> last token
    prompt_tokens_reused: int = 0  # prompt tokens whose KV came from the prefix cache (GPU)
    host_tokens_reused: int = 0  # of those, tokens brought back from the host tier
    batch_size: int = 0  # largest number of sequences in one step with this request
    first_step: int = -1  # the engine's step number when the request was first scheduled
    preemptions: int = 0


class FinishReason(StrEnum):
    """Why a request's output ended."""

    stop = "stop"  # EOS, a stop string, or the end of its grammar
    length = "length"  # `max_new_tokens` reached
    error = "error"  # it could not run (`Completion.error` says why)
    # stopped from outside (`EngineRunner.cancel`), its text so far kept
    cancelled = "cancelled"
    expired = "expired"  # its deadline passed
    shutdown = "shutdown"  # its worker is shutting down: its job goes back to the queue uncharged
    lease_lost = "lease_lost"  # its worker lost the job's lease: what it did is not its to write


FINISHED = (FinishReason.stop, FinishReason.length)  # an output that ended by itself


@dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    prompt_tokens: int
    finish_reason: FinishReason
    error: str | None = None
    timings: Timings = field(default_factory=Timings)
    retryable: bool = False  # the failure came from the engine, not from the request itself
    logprobs: list[TokenLogprobs] | None = None  # one per token of `token_ids`, when the request asked for them

    @property
    def ok(self) -> bool:
        return self.finish_reason in FINISHED

    @classmethod
    def empty(cls, request_id: str, prompt_tokens: int, finish_reason: FinishReason, error: str | None = None,
              retryable: bool = False) -> Completion:
        """A request that ended without generating anything (refused, expired or stopped before it ran)."""
        return cls(request_id, [], "", prompt_tokens, finish_reason, error, Timings(), retryable)


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters (since it started) and gauges (now), for metrics; what a backend does not have is 0."""

    running: int = 0
    waiting: int = 0
    interactive_running: int = 0
    interactive_waiting: int = 0
    kv_blocks_total: int = 0  # allocated in the pools so far
    kv_blocks_used: int = 0
    kv_blocks_peak: int = 0  # most in use after any step's scheduling
    kv_blocks_max: int = 0  # what the memory budget allows
    kv_usage: float = 0.0  # of the memory budget, not of what is allocated so far
    kv_window_blocks_used: int = 0  # of those in use, the sliding-window layers'
    preemptions: int = 0
    preemptions_spared: int = 0
    bulk_rows_deferred: int = 0
    limited_steps: int = 0
    # the step cost model's current fit, in seconds (engine.core.step_cost)
    step_fixed_s: float = 0.0
    step_per_token_s: float = 0.0
    step_per_row_s: float = 0.0
    step_per_context_s: float = 0.0
    step_per_draft_row_s: float = 0.0
    steps: int = 0
    tokens_generated: int = 0
    tokens_computed: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hit_tokens: int = 0  # host hits included
    prefix_cache_hit_rate: float = 0.0
    host_hit_tokens: int = 0
    host_prefetch_hit_rate: float = 0.0  # of the blocks copied back from the host tier, those a request then used
    prefix_cached_blocks: int = 0
    evictions: int = 0
    host_evictions: int = 0
    # speculation: draft tokens verified, of those accepted, rows that carried them, and accepted per such row
    draft_tokens: int = 0
    draft_tokens_accepted: int = 0
    draft_rows: int = 0
    draft_accepted_length: float = 0.0
    # the runner's own: its loop's idle gaps between back-to-back steps, and restarts of a stalled engine
    loop_gap_p50_ms: float = 0.0
    loop_gap_p95_ms: float = 0.0
    loop_gaps: int = 0
    restarts: int = 0


class RequestError(ValueError):
    """A request that can never run (e.g. its prompt exceeds the model's context): fails alone."""


def check_prompt(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> None:
    """Raises `RequestError` for a prompt that is empty or does not fit the model's context (`fits`)."""
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty")
    if not fits(prompt_tokens, max_new_tokens, max_model_len):
        raise RequestError(f"the prompt has {prompt_tokens} tokens; with max_new_tokens {max_new_tokens} it exceeds "
                           f"the model's context of {max_model_len} tokens")


class EngineDead(RuntimeError):
    """The engine's loop is gone: what was submitted and what is submitted now fails with it."""


class EngineStalled(EngineDead):
    """The engine loop made no progress for its stall limit while it had work: what it held was given up on."""


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop string, and whether one was found (the stop itself is dropped)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class StepEngine(Protocol):
    """A model plus its scheduler, driven from a single thread (see `engine.runtime.engine_thread.EngineThread`)."""

    tokenizer: object
    max_model_len: int

    def add_request(self, request: Request) -> None:
        """Queue a request; raises `RequestError` if it can never run. A backend may also offer
        `prepare(request)`, work on a request that reads nothing a step changes, which the runner then does
        on the submitting thread and hands to `add_request(request, prepared)` (see `LLMEngine.prepare`)."""

    def abort_request(self, request_id: str) -> Completion | None:
        """Drop a request wherever it is; returns its `cancelled` completion if it was known."""

    def partial(self, request_id: str, at_least: int) -> list[int] | None:
        """The tokens a running request has generated so far, once there are at least `at_least` of them
        (None before, or for a backend that only has whole outputs)."""

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[Completion]:
        """Run one scheduling step; returns the requests that finished in it."""

    def stats(self) -> EngineStats:
        """Counters and gauges for metrics; a runner adds its loop's own."""


class EngineRunner(Protocol):
    """A `StepEngine` behind its own step loop; every method may be called from any thread."""

    tokenizer: object
    max_model_len: int

    @property
    def alive(self) -> bool: ...

    def submit(self, request: Request, on_tokens: TokensCallback | None = None) -> Future[Completion]:
        """Queue a request; its future resolves with its completion, or fails with `EngineDead`. `on_tokens`
        is handed the output so far as it grows."""

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.cancelled) -> None: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


# --- structured outputs: the grammar a request's output follows -------------------------------------------------

# the arguments of a tool without a schema, and the answer of a `json_object` format: any JSON object
ANY_OBJECT = '{"type":"object"}'


class GrammarKind(Enum):
    JSON_SCHEMA = "json_schema"  # JSON that validates against `schema`
    FORCED_CALL = "forced_call"  # exactly one call of the one tool in `tools`
    CALLS = "calls"  # one or more calls of `tools` and nothing else (one at most without `parallel_calls`)
    CALLS_OR_JSON = "calls_or_json"  # calls as under CALLS, or JSON that validates against `schema`


@dataclass(frozen=True)
class ToolSchema:
    """A tool as the grammar needs it: its name and its arguments' JSON schema, as JSON text."""

    name: str
    parameters: str


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be, built once from its job and compiled by the engine (`engine.grammar`).

    Every schema is JSON text written once, compact and in the client's key order (the grammar emits an object's
    properties in the schema's order). Specs that are equal are one compiled grammar in the engine's cache."""

    kind: GrammarKind
    schema: str = ANY_OBJECT  # for JSON_SCHEMA and CALLS_OR_JSON
    tools: tuple[ToolSchema, ...] = ()  # for the kinds with calls
    parallel_calls: bool = True
