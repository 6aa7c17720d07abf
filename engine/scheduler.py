"""Continuous batching: which sequences run in the next step, and with how many new tokens each.

Every step decodes each running sequence and spends what is left of the token budget on prefill chunks, first
of running sequences, then of waiting requests admitted in order of urgency (priority, aged by time waited,
then arrival) while KV blocks and sequence slots last. When blocks run short, the least urgent running
sequence (lowest priority, most recently admitted) is pre-empted: its blocks are freed and it waits to be
recomputed. A waiting request may also pre-empt running ones of strictly lower priority, unless ageing already
made the running one the more urgent.

With a prefix cache, waiting requests of the same aged priority and age window go longest cached prefix first
(SGLang's longest-prefix-match order, bounded so it cannot starve anyone), and a request whose next uncached
block is being prefilled by another sequence in this step waits one step to reuse it instead of computing it
twice.
"""

from __future__ import annotations

import itertools
import math

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_query_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found there
        self.num_host_hit_tokens = 0  # of those, tokens the host tier had brought back
        self._admissions = itertools.count()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is and give its blocks back at once."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def schedule(self, now: float) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) for the next step; its blocks are allocated on return."""
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk_size
        scheduled: dict[Sequence, int] = {}
        computing: set[int] = set()  # keys of the blocks this step's prefill chunks fill
        # decodes before prefill chunks, most urgent first, so that pre-emption victims come last
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed > 1, -s.priority, s.admitted)):
            n = min(seq.num_uncomputed, chunk, budget)
            if seq.status is not Status.RUNNING or n == 0:
                continue
            self.blocks.recycle(seq)
            while seq.status is Status.RUNNING and not self.blocks.try_append(seq, n):
                budget += self._preempt(self._victim(), scheduled)
            if seq.status is Status.RUNNING:
                scheduled[seq] = n
                budget -= n
                self._mark_computing(seq, n, computing)

        # cached prefixes only order admissions; with every sequence slot taken none is admitted this step
        # (short of pre-emption, which goes by priority), so skip looking up every waiting prompt
        room = len(self.running) < self.config.max_num_seqs
        cached = {seq: len(self.blocks.cached_prefix(seq)) for seq in self.waiting} if room else {}
        self.waiting.sort(key=lambda s: self._admission_order(s, now, cached.get(s, 0)))
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if self._next_block_in_flight(seq, computing):
                i += 1
                continue
            if len(self.running) < self.config.max_num_seqs and self._admit(seq, budget):
                self.waiting.pop(i)
                scheduled[seq] = n = min(seq.num_uncomputed, chunk, budget)
                budget -= n
                self._mark_computing(seq, n, computing)
                continue
            victim = self._victim()
            # higher priority pre-empts, unless the victim has aged past the newcomer (which would thrash)
            rate = self.config.ageing_rate
            if victim is None or victim.priority >= seq.priority or victim.urgency(now, rate) >= seq.urgency(now, rate):
                break
            budget += self._preempt(victim, scheduled)
        return list(scheduled.items())

    def _admission_order(self, seq: Sequence, now: float, cached_blocks: int) -> tuple[float, ...]:
        urgency = math.floor(seq.urgency(now, self.config.ageing_rate))
        window = math.floor((now - seq.request.arrival) / self.config.cache_aware_window)
        return -urgency, -window, -cached_blocks, seq.request.arrival

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give `seq` its cached prefix and the blocks of its first chunk; False, nothing taken, if short."""
        reused, from_host = self.blocks.reuse(seq)
        if not self.blocks.try_append(seq, min(seq.num_uncomputed, self.config.prefill_chunk_size, budget)):
            self.blocks.free(seq)
            seq.num_computed = 0
            return False
        if seq.admitted < 0:  # what the request saved, not what a re-admission after pre-emption did
            seq.timings.prompt_tokens_reused, seq.timings.host_tokens_reused = reused, from_host
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += reused
        self.num_host_hit_tokens += from_host
        seq.status, seq.admitted = Status.RUNNING, next(self._admissions)
        self.running.append(seq)
        return True

    def _mark_computing(self, seq: Sequence, n: int, computing: set[int]) -> None:
        size = self.blocks.block_size
        last = min(-(-(seq.num_computed + n) // size), len(seq.block_keys))
        computing.update(entry.key for entry in seq.block_keys[seq.num_computed // size:last])

    def _next_block_in_flight(self, seq: Sequence, computing: set[int]) -> bool:
        if not computing:
            return False
        blocks = len(self.blocks.cached_prefix(seq))
        return blocks < len(seq.block_keys) and seq.block_keys[blocks].key in computing

    def _victim(self) -> Sequence | None:
        return max(self.running, key=lambda s: (-s.priority, s.admitted), default=None)

    def _preempt(self, seq: Sequence, scheduled: dict[Sequence, int]) -> int:
        """Send `seq` back to waiting with no blocks; returns the budget it had taken in this step."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.timings.preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        return scheduled.pop(seq, 0)
