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
costs the step's time over the tokens it yields; a draft token costs the fit's per-token time. A certain draft
is proposed whenever the first exceeds the second; the j-th other draft of a kind while its chance of being
reached and accepted (`engine.core.draft_record`: the sequence's own record of that kind) times the first does: on a small step almost every match is worth it, while a
large batch, whose step time a few more tokens per row raises in proportion, proposes nothing, as vLLM turns
drafting off past a batch size.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.sequence import Sequence
from engine.core.step_cost import StepCost, Work

MAX_WAIT = 8  # the most steps a sequence whose lookups keep finding nothing skips between two


class GrammarDrafts(Protocol):
    """What drafting asks of a sequence's grammar matcher (`engine.grammar.Grammars`)."""

    def forced(self, matcher: object, limit: int) -> tuple[list[int], int]:
        """At most `limit` tokens of the text the grammar forces next, and how many of them, leading, are certain."""

    def valid(self, matcher: object, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts in turn (the matcher left as it was)."""


def token_value(cost: StepCost, work: Work, rows: int) -> float:
    """What a token the planned step yields costs (its predicted time over its `rows` sampling rows), over what
    one more token of it costs: a draft accepted with a chance above 1 / this is worth proposing."""
    per_token = cost.predict(Work(work.prefill_tokens + 1, work.decode_rows, work.decode_longest)) - cost.predict(work)
    return cost.predict(work) / max(rows, 1) / max(per_token, 1e-12)


class Drafter:
    def __init__(self, grammar: GrammarDrafts | None, stop_ids: set[int], think_close: int | None) -> None:
        self.grammar = grammar
        self.stop_ids = stop_ids
        self.think_close = think_close

    def propose(self, seq: Sequence, cap: int, value: float) -> list[int]:
        """Up to `cap` drafts for `seq` (its last token not yet computed): the certain ones its grammar forces,
        the grammar's others, then n-gram ones; `value` is `token_value` of the step. Sets `seq.certain` and
        `seq.forced`."""
        drafts, certain = [], 0
        constrained = seq.matcher is not None and seq.constrained and self.grammar is not None
        if constrained:
            drafts, certain = self.grammar.forced(seq.matcher, cap)
            drafts = drafts[:certain + seq.forced_record.worth(value)]
        seq.certain, seq.forced = certain, len(drafts) - certain
        more = self._copied(seq, drafts, min(cap - len(drafts), seq.copied_record.worth(value)))
        drafts += self._before_an_end(seq, more)
        if constrained and drafts:
            drafts = drafts[:self.grammar.valid(seq.matcher, drafts)]
        return drafts

    def _copied(self, seq: Sequence, drafts: list[int], k: int) -> list[int]:
        """Up to `k` n-gram drafts after `drafts`. A lookup that finds nothing makes the sequence's next ones
        wait a step longer each time (up to `MAX_WAIT`): output with nothing to copy costs a lookup every few
        steps, not one a step, and one that starts copying is caught within a few tokens."""
        if k <= 0:
            return []
        if seq.draft_wait > 0:
            seq.draft_wait -= 1
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
            seq.forced_record.fold(hits, min(forced, hits + 1))
        if copied and rest >= forced:
            hits = rest - forced
            seq.copied_record.fold(hits, min(copied, hits + 1))
