"""Which draft tokens a decoding sequence carries into a step, where one forward verifies them all.

A decode row that carries k drafts becomes a row of 1 + k tokens whose every position samples; the tokens it
keeps are those sampled up to the first that differs from the draft before it (`engine.model.acceptance`),
so the output is what decoding one token a step gives, and a step yields up to k + 1 tokens of the sequence.

Drafts cost no model of their own:

- the tokens of the text its grammar forces next (`GrammarDrafts.forced`: a JSON key, a brace, the tail of an
  enum's value): certain where the grammar allows a single token, and where it allows several ways to split
  the text the longest tokens, which a model writes the way its tokenizer would;
- then tokens copied from after the last earlier occurrence of its last few tokens (`engine.core.ngram`).

Whether a draft is worth its place is the step cost's call (`engine.core.step_cost`): a token the step yields
costs the step's time over the tokens it yields; a draft token costs the fit's per-token time, and a row that
carries drafts the fit's per-draft-row time besides. A certain draft is proposed whenever the first exceeds the
second; the j-th other draft of a kind while its chance of being reached and accepted
(`engine.core.draft_record`: the sequence's own record of that kind) times the first does; and a row's drafts
only while the tokens they are expected to yield are worth their tokens and their row together. On a small
step almost every match is worth it, while a large batch, whose step time a few more tokens per row raises in
proportion, proposes nothing, as vLLM turns drafting off past a batch size; on a device where a row verifying
drafts costs more than a decode row (a CPU), only rows likely to keep several drafts carry them.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from engine.core.draft_record import Record
from engine.core.sequence import Sequence
from engine.core.step_cost import StepCost, Work

MAX_WAIT = 8  # the most steps a sequence whose lookups keep finding nothing skips between two
# The engine's records, which a sequence's own start from: optimistic at first, so that a new engine tries its
# drafts, then each verified row of any sequence counts (an engine's workload changes slowly), and each new
# sequence moves them back a little towards the optimistic start, so that an engine whose drafts were rejected
# tries again now and then, should its requests have started to copy.
OPTIMISTIC = 0.9
ENGINE_DECAY = 0.95
RETRY = 0.02


class GrammarDrafts(Protocol):
    """What drafting asks of a sequence's grammar matcher (`engine.grammar.Grammars`)."""

    def forced(self, matcher: object, limit: int) -> tuple[list[int], int]:
        """At most `limit` tokens of the text the grammar forces next, and how many of them, leading, are certain."""

    def valid(self, matcher: object, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts in turn (the matcher left as it was)."""


class Prices(NamedTuple):
    """A planned step's prices, in draft tokens (what one more token of the step costs)."""

    token: float  # a token the step yields: its predicted time over its sampling rows
    row: float  # making one of its decode rows a row that verifies drafts, beyond the drafts' own tokens


def prices(cost: StepCost, work: Work, rows: int) -> Prices:
    """The prices of a step doing `work` with `rows` sampling rows: a draft accepted with a chance above 1 /
    `token` is worth its token."""
    base = cost.predict(work)
    unit = max(cost.predict(work._replace(prefill_tokens=work.prefill_tokens + 1)) - base, 1e-12)
    row = cost.predict(work._replace(draft_rows=work.draft_rows + 1)) - base
    return Prices(base / max(rows, 1) / unit, row / unit)


class Drafter:
    def __init__(self, grammar: GrammarDrafts | None, stop_ids: set[int], think_close: int | None) -> None:
        self.grammar = grammar
        self.stop_ids = stop_ids
        self.think_close = think_close
        self.copied = Record(4 * OPTIMISTIC, 4.0, ENGINE_DECAY)
        self.forced = Record(4 * OPTIMISTIC, 4.0, ENGINE_DECAY)

    def propose(self, seq: Sequence, cap: int, price: Prices) -> list[int]:
        """Up to `cap` drafts for `seq` (its last token not yet computed): the certain ones its grammar forces,
        the grammar's others, then n-gram ones, none unless together they are worth their row (`price`, the
        step's `prices`). Sets `seq.certain` and `seq.forced`."""
        value = price.token
        if seq.copied_record is None or seq.forced_record is None:
            self._start(seq)
        drafts, certain = [], 0
        constrained = seq.matcher is not None and seq.constrained and self.grammar is not None
        waiting = seq.draft_wait > 0  # its lookups keep finding nothing: none this step
        if waiting:
            seq.draft_wait -= 1
        if waiting and not constrained:  # and no grammar forces anything: nothing to weigh either
            seq.certain = seq.forced = 0
            return []
        if constrained:
            drafts, certain = self.grammar.forced(seq.matcher, cap)
            drafts = drafts[:certain + seq.forced_record.worth(value)]
        seq.certain, seq.forced = certain, len(drafts) - certain
        room = 0 if waiting else min(cap - len(drafts), seq.copied_record.worth(value))
        kept = self._expected(seq, len(drafts) + room)
        if max(value * kept[k] - k for k in range(len(drafts), len(drafts) + room + 1)) < price.row:
            # no row of its drafts could pay for itself whatever a lookup found: skip the lookup, or a sequence
            # whose output repeats itself would pay one every step for drafts it never carries
            return []
        drafts += self._before_an_end(seq, self._copied(seq, drafts, room))
        if constrained and drafts:
            drafts = drafts[:self.grammar.valid(seq.matcher, drafts)]
        if drafts and value * kept[len(drafts)] < len(drafts) + price.row:
            return []
        return drafts

    def _start(self, seq: Sequence) -> None:
        """A sequence's first records (those it lacks): the engine's rates, which it moves back a little towards
        the optimistic start."""
        if seq.copied_record is None:
            seq.copied_record = self.copied.start()
            self.copied.relax(OPTIMISTIC, RETRY)
        if seq.forced_record is None:
            seq.forced_record = self.forced.start()
            self.forced.relax(OPTIMISTIC, RETRY)

    def _expected(self, seq: Sequence, k: int) -> list[float]:
        """The drafts a row of its first j of `k` drafts (`seq.certain` certain ones, then `seq.forced` other
        forced ones, then copied ones) is expected to keep, for j = 0..k: each is kept only if every one before
        it was."""
        certain = min(seq.certain, k)
        forced = min(seq.forced, k - certain)
        expected, reached = [float(j) for j in range(certain + 1)], 1.0
        for rate, n in ((seq.forced_record.rate, forced), (seq.copied_record.rate, k - certain - forced)):
            for _ in range(n):
                reached *= rate
                expected.append(expected[-1] + reached)
        return expected

    def _copied(self, seq: Sequence, drafts: list[int], k: int) -> list[int]:
        """Up to `k` n-gram drafts after `drafts`. A lookup that finds nothing makes the sequence's next ones
        wait a step longer each time (up to `MAX_WAIT`, `seq.draft_wait`, counted down by `propose`): output with
        nothing to copy costs a lookup every few steps, not one a step, and one that starts copying is caught
        within a few tokens."""
        if k <= 0:
            return []
        found = seq.ngram.propose(seq.token_ids, drafts, k)
        seq.draft_misses = 0 if found else min(seq.draft_misses + 1, MAX_WAIT)
        seq.draft_wait = seq.draft_misses
        return found

    def _before_an_end(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """`tokens` up to a stop token, and up to a `</think>` where a grammar waits for it: a draft after either
        would be sampled as if nothing had ended, and the sampled end itself closes the step's row anyway."""
        ends = set() if seq.params.ignore_eos else self.stop_ids
        if seq.matcher is not None and not seq.constrained and self.think_close is not None:
            ends = ends | {self.think_close}
        for i, t in enumerate(tokens):
            if t in ends:
                return tokens[:i]
        return tokens

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Fold a verified row into `seq`'s records: of its `drafted` drafts (`seq.certain` certain ones, then
        `seq.forced` other forced ones, then n-gram ones; fewer if the row could hold fewer) `accepted` were.
        Each kind counts its drafts reached, and of those the ones accepted."""
        certain = min(seq.certain, drafted)
        forced = min(seq.forced, drafted - certain)
        copied, rest = drafted - certain - forced, accepted - certain
        if forced and rest >= 0:
            hits = min(rest, forced)
            for record in (seq.forced_record, self.forced):
                record.fold(hits, min(forced, hits + 1))
        if copied and rest >= forced:
            hits = rest - forced
            for record in (seq.copied_record, self.copied):
                record.fold(hits, min(copied, hits + 1))
