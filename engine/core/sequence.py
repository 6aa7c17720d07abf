"""One request's life inside the engine: its tokens, how many of them are in the KV cache, its blocks."""

from __future__ import annotations

from enum import Enum, auto

from engine.core.block_key import BlockKey, salt_root
from engine.core.draft_record import Record
from engine.core.ngram import NgramIndex
from engine.core.output_text import stop_ends, stop_window
from engine.interface import Request, Timings


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request: Request, num_pools: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.params = request.sampling
        self.token_ids = list(request.prompt_ids)
        self.num_prompt_tokens = len(request.prompt_ids)
        # it finishes by length once it holds this many tokens (prompt included); a request fits the context
        # whole (`engine.interface.fits`), so this is all it ever holds
        self.token_limit = self.num_prompt_tokens + self.params.max_new_tokens
        self.stop_window = stop_window(self.params.stop)  # output tokens a stop string can span
        self.stop_ends = stop_ends(self.params.stop)  # characters a token completing a stop string holds
        self.reasoning_budget = self.params.max_thinking_tokens  # None: its reasoning may run on
        # a penalty reads the token history: only such rows hand theirs to the sampler
        self.penalized = self.params.repetition_penalty != 1.0 or self.params.presence_penalty != 0.0
        # Tokens whose K/V is in the cache. A step computes `token_ids[num_computed:]` (or a chunk of it) and
        # samples when it reaches the end, so prefill, chunked prefill, decode and recompute after pre-emption
        # are one code path.
        self.num_computed = 0
        self.block_tables: list[list[int]] = [[] for _ in range(num_pools)]  # one per KV pool, of one length
        self.table_row = -1  # its row of the block manager's `TableRows` while it holds blocks
        self.block_keys: list[BlockKey] = []  # content keys of the full blocks of `token_ids`, as needed
        self.cache_root = salt_root(request.cache_salt)  # the parent key of its first block
        self.num_indexed = 0  # leading blocks of the first table already offered to the prefix cache
        self.status = Status.WAITING
        self.admitted = -1  # admission counter: the most recently admitted sequence is pre-empted first
        self.last_step = -1  # the scheduler's last step that ran this sequence
        self.interactive = request.interactive
        self.think_block_tokens: int | None = None  # tokens in its open <think> block; None: no block open
        # its grammar's matcher (`engine.grammar`), which follows every token it outputs; it constrains the
        # sampling once `constrained` (at once, or after the reasoning's `</think>`)
        self.matcher = None
        self.constrained = False
        self.logprobs: list | None = [] if self.params.logprobs is not None else None  # one per output token
        # speculation (engine.core.drafts): the index its n-gram drafts come from (None: it never speculates), the
        # drafts of the step it is planned in (read only by a row longer than its uncomputed tokens), how many of
        # them its grammar forced (certain, then the others), how often each uncertain kind was accepted (None
        # until it first drafts: then the engine's sequences' rate so far), and its lookups that found nothing in a
        # row, and steps to skip before the next
        self.ngram: NgramIndex | None = None
        self.drafts: list[int] = []
        self.certain = 0
        self.forced = 0
        self.copied_record: Record | None = None
        self.forced_record: Record | None = None
        self.draft_misses = 0
        self.draft_wait = 0
        self.timings = Timings()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def output_tail(self, n: int) -> list[int]:
        """The last `n` output tokens (fewer when the output is shorter), without copying the whole output."""
        return self.token_ids[max(self.num_prompt_tokens, len(self.token_ids) - n):]

    def urgency(self, now: float, ageing_rate: float) -> float:
        """Priority plus what it gained by waiting since arrival (for a job: since it was created)."""
        return self.request.priority + ageing_rate * (now - self.request.arrival)

    def record_step(self, step: int, start: float, end: float, batch_size: int, prefilled: bool) -> None:
        t = self.timings
        if self.first_scheduled is None:
            self.first_scheduled = start
            t.queue_wait_ms = (start - self.request.arrival) * 1e3
            t.first_step = step
        if prefilled:
            t.prefill_ms += (end - start) * 1e3
        t.batch_size = max(t.batch_size, batch_size)

    def final_timings(self) -> Timings:
        """`timings` with what is derived only once the request ends (the engine stores just the times)."""
        if self.first_token is not None:
            self.timings.decode_ms = (self.last_token - self.first_token) * 1e3
        return self.timings
