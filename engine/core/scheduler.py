"""Continuous batching with latency targets: which sequences run in the next step, with how many tokens each.

Requests are interactive (a person waits on every token) or bulk. A step takes all interactive work first,
admitting waiting interactive requests by pre-empting bulk ones if need be; bulk work (decodes, then prefill
chunks, then admissions) fills it up to a time limit: the interactive work's latency target, or while
interactive traffic is about a length that keeps a newcomer's wait short, or with none only the token budget.
What a step will take comes from `StepCost`, fitted online. Waiting requests are admitted by class, urgency
(priority plus ageing from arrival), deadline, then fewest uncached tokens among those that arrived within
`length_window` of each other. When blocks run short the least urgent running sequence is pre-empted and
recomputed later (its full blocks stay cached); one pre-empted `max_preemptions` times is spared after that.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.block_key import BlockKey
from engine.core.block_manager import BlockManager
from engine.core.drafts import Drafter, prices
from engine.core.sequence import Sequence, Status
from engine.core.step_cost import StepCost, Work
from engine.core.step_rows import step_plan
from engine.step import StepPlan


@dataclass
class Planning:
    """The step being planned: what runs, and the work that adds up to (kept as plain counters: the planner
    adds hundreds of rows a step)."""

    tokens_left: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)
    # the entries of the blocks this step's prefill chunks fill (whole entries: a request waits only for its own
    # salt's blocks, never for a key of another salt's that collides with one of its own)
    computing: set[BlockKey] = field(default_factory=set)
    prefill_tokens: int = 0  # a decode row's drafts count here: tokens of compute beside the row's own
    decode_rows: int = 0
    decode_longest: int = 0
    drafts: int = 0
    draft_rows: int = 0

    @property
    def work(self) -> Work:
        return Work(self.prefill_tokens, self.decode_rows, self.decode_longest, self.draft_rows)

    def add(self, seq: Sequence, n: int) -> None:
        self.scheduled[seq] = n
        self.tokens_left -= n
        if n == 1:
            self.decode_rows += 1
            self.decode_longest = max(self.decode_longest, seq.num_computed + 1)
        else:
            self.prefill_tokens += n

    def add_decodes(self, seqs: list[Sequence]) -> None:
        """`add(seq, 1)` for each of `seqs`, none of them planned yet."""
        if seqs:
            self.scheduled.update(dict.fromkeys(seqs, 1))
            self.tokens_left -= len(seqs)
            self.decode_rows += len(seqs)
            self.decode_longest = max(self.decode_longest, max(seq.num_computed for seq in seqs) + 1)

    def add_drafts(self, seq: Sequence, k: int) -> None:
        """`k` drafts on planned decode row `seq` (engine.core.drafts)."""
        self.scheduled[seq] += k
        self.tokens_left -= k
        self.prefill_tokens += k
        self.drafts += k
        self.draft_rows += 1

    def remove(self, seq: Sequence) -> None:
        """(A row taken out leaves the longest context as it was: an estimate on the safe side.)"""
        n = self.scheduled.pop(seq, 0)
        self.tokens_left += n
        if n == 1:
            self.decode_rows -= 1
        elif n:
            self.prefill_tokens -= n


def plus(work: Work, seq: Sequence, n: int) -> Work:
    """`work` with `n` more tokens of `seq`: a decode row, or a prefill chunk."""
    if n == 1:
        return work._replace(decode_rows=work.decode_rows + 1, decode_longest=max(work.decode_longest,
                                                                                 seq.num_computed + 1))
    return work._replace(prefill_tokens=work.prefill_tokens + n)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, cost: StepCost | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.cost = cost or StepCost()
        self.drafter: Drafter | None = None  # the engine's, once it has its grammars: no drafts without one
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_preemptions_spared = 0  # newcomers' pre-emptions not done: the victim had taken enough
        self.num_rows_deferred = 0  # bulk decode rows left out of a step to keep its time limit
        self.num_limited_steps = 0  # steps that a latency target or a newcomer's wait kept short
        self.num_query_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens found there
        self.num_host_hit_tokens = 0  # of those, tokens the host tier had brought back
        self.last_interactive = -math.inf  # when an interactive request last arrived or waited
        self._admissions = itertools.count()
        self._step = 0
        self._released: list[str] = []  # finished or pre-empted since the last plan (`StepPlan.released`)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is and give its blocks back at once."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        self._released.append(seq.request_id)

    def schedule(self, now: float) -> StepPlan | None:
        """The next step, its blocks allocated; None when nothing can run."""
        self._step += 1
        planning = Planning(self.config.max_num_batched_tokens)
        # 1. interactive work, whole: decodes before prefill chunks, most urgent first
        for seq in sorted((s for s in self.running if s.interactive),
                          key=lambda s: (s.num_uncomputed > 1, -s.priority, s.admitted)):
            n = min(seq.num_uncomputed, self.config.prefill_chunk_size, planning.tokens_left)
            self._schedule(seq, n, planning)
        urgent = [s for s in self.waiting if s.interactive]
        if urgent or planning.scheduled:
            self.last_interactive = now
        self._admit(self._admission_order(urgent, now), planning, math.inf, now)
        # 2. bulk work, up to the step's time limit
        limit = self._time_limit(planning, now)
        self.num_limited_steps += limit < math.inf
        decodes, prefills = [], []
        for seq in self.running:
            if not seq.interactive:
                (decodes if seq.num_uncomputed == 1 else prefills).append(seq)
        if limit == math.inf and len(decodes) <= planning.tokens_left:  # every one runs: no order to keep
            self._schedule_decodes(decodes, planning)
        else:
            decodes.sort(key=lambda s: (s.last_step < self._step - 1, s.last_step, s.admitted))
            for i, seq in enumerate(decodes):
                # a step always carries some work: the first row goes in whatever the limit says
                if planning.tokens_left < 1 or (limit < math.inf and planning.scheduled
                                                and self.cost.predict(plus(planning.work, seq, 1)) > limit):
                    self.num_rows_deferred += len(decodes) - i  # the rest would not fit either
                    break
                self._schedule(seq, 1, planning)
        for seq in sorted(prefills, key=lambda s: s.admitted):
            if seq.status is Status.RUNNING:
                self._schedule(seq, self._chunk(seq, planning, limit), planning)
        if not planning.scheduled or min(planning.tokens_left, self._spare_tokens(planning, limit)) > 0:
            # else ordering the backlog is wasted
            bulk = self._admission_order([s for s in self.waiting if not s.interactive], now)
            self._admit(bulk, planning, limit, now)
        if not planning.scheduled:
            return None
        if self.drafter is not None:
            self._draft(planning, limit)
        for seq in planning.scheduled:
            seq.last_step = self._step
        released, self._released = self._released, []
        return step_plan(planning.scheduled, self.blocks.rows, self.blocks.block_size, released, planning.drafts)

    def _draft(self, planning: Planning, limit: float) -> None:
        """Drafts on the step's decode rows of speculating sequences, as many as are worth their cost
        (engine.core.drafts), within the token budget, the time limit and the blocks each row holds or can take."""
        rows = [seq for seq, n in planning.scheduled.items() if n == 1 and seq.ngram is not None
                and seq.num_uncomputed == 1]
        if not rows:
            return
        price = prices(self.cost, planning.work, planning.decode_rows)
        if price.token <= 1:
            return
        size = self.blocks.block_size
        room = min(planning.tokens_left, self._spare_tokens(planning, limit))
        for seq in rows:
            cap = min(self.config.speculative_tokens, int(room), seq.token_limit - seq.num_tokens - 1)
            drafts = self.drafter.propose(seq, cap, price) if cap > 0 else []
            if drafts and not self.blocks.try_append(seq, 1 + len(drafts)):
                del drafts[len(seq.block_tables[0]) * size - seq.num_computed - 1:]  # what its blocks hold
            if drafts:
                seq.drafts = drafts
                planning.add_drafts(seq, len(drafts))
                # what the time limit has left, in tokens: the drafts' own and their row's cost (`price.row`
                # is in tokens), without asking the fit again for every row
                room -= len(drafts) + price.row

    def _time_limit(self, planning: Planning, now: float) -> float:
        """Seconds this step may take once its interactive work is in: that work's latency target, a newcomer's
        wait while interactive traffic is about, or no limit."""
        c = self.config
        if not planning.scheduled:
            if now - self.last_interactive > c.interactive_window:
                return math.inf
            # sized from the cheapest recent step too: with the fitted fixed part alone, a fit that brought it
            # near zero sized every step to nothing, and bulk work waited out the whole window
            return max(self.cost.predict(Work()), self.cost.cheapest) / c.bulk_step_overhead
        alone = self.cost.predict(planning.work)
        limits = []
        if planning.work.decode_rows:
            limits.append(c.interactive_tpot_ms / 1e3 or c.interactive_slowdown * alone)
        if planning.work.prefill_tokens:
            limits.append(c.interactive_ttft_ms / 1e3 or c.interactive_slowdown * alone)
        return max(min(limits), alone)

    def _spare_tokens(self, planning: Planning, limit: float) -> int:
        """Prefill tokens the step's time limit still allows (its token budget aside)."""
        if limit == math.inf:
            return planning.tokens_left
        per_token = self.cost.predict(Work(prefill_tokens=1000)) - self.cost.predict(Work())
        spare = limit - self.cost.predict(planning.work)
        return max(0, int(1000 * spare / max(per_token, 1e-9)))

    def _chunk(self, seq: Sequence, planning: Planning, limit: float, uncomputed: int | None = None) -> int:
        """Tokens of `seq`'s prompt (of its `uncomputed` ones, when given) to prefill in this step, within the
        token budget and the time limit; 0 when the time limit leaves only a sliver (less than a block), not
        worth a pass."""
        n = min(seq.num_uncomputed if uncomputed is None else uncomputed, self.config.prefill_chunk_size,
                planning.tokens_left)
        timed = min(n, self._spare_tokens(planning, limit))
        if not planning.scheduled:  # a step always carries some work: a block's worth whatever the limit says
            timed = max(timed, min(n, self.blocks.block_size))
        return timed if timed == n or timed >= self.blocks.block_size else 0

    def _schedule(self, seq: Sequence, n: int, planning: Planning) -> None:
        """Schedule `n` tokens of running `seq`, pre-empting others (or `seq` itself) when blocks are short."""
        if n <= 0 or seq.status is not Status.RUNNING:
            return
        if self.blocks.windowed:
            self.blocks.recycle(seq)
        while seq.status is Status.RUNNING and not self.blocks.try_append(seq, n):
            self._preempt(self._victim(seq, for_room=True), planning)
        if seq.status is Status.RUNNING:
            planning.add(seq, n)
            self._mark_computing(seq, n, planning.computing)

    def _schedule_decodes(self, decodes: list[Sequence], planning: Planning) -> None:
        """`_schedule(seq, 1, planning)` for each of `decodes` (running bulk sequences that all fit in the step, so
        their order does not change which run). Most have room for the token in their last block and leave
        `_mark_computing` nothing to mark (their block has no content key yet): those go into the plan in one
        go. The others (a block to take, maybe a pre-emption) go one by one, in admission order; with
        sliding-window pools every row does (its ring blocks are recycled first)."""
        size = self.blocks.block_size
        plain, rest = [], []
        if self.blocks.windowed:
            rest = decodes
        else:
            for seq in decodes:
                at = seq.num_computed
                has_room = at < len(seq.block_tables[0]) * size
                (plain if has_room and at // size >= len(seq.block_keys) else rest).append(seq)
        planning.add_decodes(plain)
        for seq in sorted(rest, key=lambda s: s.admitted):
            self._schedule(seq, 1, planning)

    def _admission_order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        """`seqs` (waiting, of one class) in the order they are to be admitted."""
        # cached prefixes only order admissions; with every sequence slot taken only pre-emption lets one in,
        # which goes by priority, so skip looking up every waiting prompt
        room = len(self.running) < self.config.max_num_seqs
        size = self.blocks.block_size
        cached = {seq: len(self.blocks.cached_prefix(seq)) * size for seq in seqs} if room else {}

        def key(seq: Sequence) -> tuple[float, ...]:
            urgency = math.floor(seq.urgency(now, self.config.ageing_rate))
            window = math.floor((now - seq.request.arrival) / self.config.length_window)
            deadline = seq.request.deadline if seq.request.deadline is not None else math.inf
            return -urgency, deadline, -window, seq.num_tokens - cached.get(seq, 0), seq.request.arrival

        return sorted(seqs, key=key)

    def _admit(self, candidates: list[Sequence], planning: Planning, limit: float, now: float) -> None:
        """Admit `candidates` in order while the step has room, pre-empting less urgent work for them."""
        for seq in candidates:
            if planning.tokens_left <= 0:
                return
            if self._next_block_in_flight(seq, planning.computing):
                continue
            while (admitted := self._try_admit(seq, planning, limit)) is None:
                victim = self._victim(seq, for_room=False)
                if (victim is None or not self._may_preempt(seq, victim, now)
                        or not self._has_time(seq, planning, limit)):
                    return
                self._preempt(victim, planning)
            if not admitted:  # the step has no time left for another chunk
                return

    def _has_time(self, seq: Sequence, planning: Planning, limit: float) -> bool:
        """Whether the step has time for a chunk of waiting `seq` (its cached prefix aside): asked before
        someone is pre-empted to make room for it."""
        cached = len(self.blocks.cached_prefix(seq)) * self.blocks.block_size
        return self._chunk(seq, planning, limit, seq.num_tokens - cached) > 0

    def _try_admit(self, seq: Sequence, planning: Planning, limit: float) -> bool | None:
        """Give `seq` a slot, its cached prefix and the blocks of its first chunk: True when admitted, False when
        the step has no time left for it, None (nothing taken) when slots or blocks are short."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        reused, from_host = self.blocks.reuse(seq)
        n = self._chunk(seq, planning, limit)
        if n == 0 or not self.blocks.try_append(seq, n):
            self.blocks.free(seq)
            seq.num_computed = 0
            return False if n == 0 else None
        if seq.admitted < 0:  # what the request saved, not what a re-admission after pre-emption did
            seq.timings.prompt_tokens_reused, seq.timings.host_tokens_reused = reused, from_host
        self.num_query_tokens += seq.num_tokens
        self.num_hit_tokens += reused
        self.num_host_hit_tokens += from_host
        seq.status, seq.admitted = Status.RUNNING, next(self._admissions)
        self.waiting.remove(seq)
        self.running.append(seq)
        planning.add(seq, n)
        self._mark_computing(seq, n, planning.computing)
        return True

    def _may_preempt(self, newcomer: Sequence, victim: Sequence, now: float) -> bool:
        """An interactive newcomer may displace any bulk sequence; otherwise only one of strictly lower priority
        that ageing has not already made the more urgent (which would thrash)."""
        if newcomer.interactive and not victim.interactive:
            return True
        rate = self.config.ageing_rate
        return victim.priority < newcomer.priority and victim.urgency(now, rate) < newcomer.urgency(now, rate)

    def _victim(self, seq: Sequence, for_room: bool) -> Sequence | None:
        """The least urgent running sequence `seq` may displace: bulk before interactive, never interactive for
        bulk. For blocks that running work needs (`for_room`) it may be `seq` itself, which then waits, and
        sequences pre-empted often are taken last; to admit a newcomer, those are spared."""
        mine = seq.interactive
        candidates = [s for s in self.running if mine or not s.interactive]
        if mine and any(not s.interactive for s in candidates):
            candidates = [s for s in candidates if not s.interactive]

        def order(s: Sequence) -> tuple[int, ...]:
            return s.timings.preemptions < self.config.max_preemptions, -s.interactive, -s.priority, s.admitted

        if not for_room:
            candidates = [s for s in candidates if s is not seq]
            best = max(candidates, key=order, default=None)
            if best is not None and best.timings.preemptions >= self.config.max_preemptions:
                self.num_preemptions_spared += 1
                return None
            return best
        return max(candidates, key=order, default=None)

    def _mark_computing(self, seq: Sequence, n: int, computing: set[BlockKey]) -> None:
        size = self.blocks.block_size
        first = seq.num_computed // size
        if first >= len(seq.block_keys):  # a decode into a block not full yet: nothing another could reuse
            return
        last = min(-(-(seq.num_computed + n) // size), len(seq.block_keys))
        computing.update(seq.block_keys[first:last])

    def _next_block_in_flight(self, seq: Sequence, computing: set[BlockKey]) -> bool:
        """Whether another sequence fills `seq`'s next uncached block in this step: `seq` then waits a step to
        reuse it instead of computing it twice."""
        if not computing:
            return False
        blocks = len(self.blocks.cached_prefix(seq))
        return blocks < len(seq.block_keys) and seq.block_keys[blocks] in computing

    def _preempt(self, seq: Sequence, planning: Planning) -> None:
        """Send `seq` back to waiting with no blocks, and out of this step."""
        planning.remove(seq)
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.timings.preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        self._released.append(seq.request_id)
