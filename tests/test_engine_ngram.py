"""Draft proposals: the n-gram index of a sequence's own tokens, and what the drafter makes of it."""

from __future__ import annotations

import random

import pytest

from engine.core.draft_record import Record
from engine.core.drafts import RETRY, Drafter, Prices
from engine.core.ngram import CANDIDATES, NgramIndex
from engine.core.sequence import Sequence
from engine.core.step_cost import StepCost, Work
from engine.interface import Request, SamplingParams


def brute_force(tokens: list[int], extra: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What `NgramIndex.propose` promises, by scanning the whole history."""
    context = tokens + extra
    tail = context[-max_n:]
    if len(tail) < min_n:
        return []
    ends = [e for e in range(min_n, len(tokens)) if tokens[e - min_n:e] == tail[-min_n:]][::-1][:CANDIDATES]
    best, best_len = -1, 0
    for e in ends:
        length = next(n for n in range(len(tail), min_n - 1, -1) if n <= e and tokens[e - n:e] == tail[-n:])
        if length > best_len:
            best, best_len = e, length
    if best < 0:
        return []
    proposed = []
    for i in range(k):  # what followed, and past the end the same period again
        proposed.append((context + proposed)[best + i])
    return proposed


def test_it_proposes_what_followed_the_longest_of_the_recent_matches():
    index = NgramIndex(2, 4)
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 7, 1, 2, 3]
    # "2 3" last ended at 8 (then 7), but "1 2 3" matches further back where it ended at 3 (then 4 5)
    assert index.propose(tokens, [], 3) == [4, 5, 9]
    assert index.propose(tokens, [], 1) == [4]
    assert index.propose([5, 6, 7, 8], [], 4) == []  # nothing seen twice
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5, 9, 2, 3], [7, 7], 2) == []  # "7 7" never appeared
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5, 9], [1, 2], 3) == [3, 4, 5]  # drafts already chosen count


def test_a_loop_is_proposed_past_the_end_of_the_sequence():
    assert NgramIndex(2, 4).propose([8, 5, 6, 5, 6, 5], [], 5) == [6, 5, 6, 5, 6]
    assert NgramIndex(1, 3).propose([4, 4, 4], [], 4) == [4, 4, 4, 4]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_proposals_are_those_of_a_scan_of_the_whole_history(min_n, max_n):
    """Small vocabularies, so that matches of every length and long chains of occurrences happen; the index is
    kept across a growing sequence, as a sequence's is across its steps."""
    rng = random.Random(min_n * 10 + max_n)
    for vocab in (3, 6, 20):
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(300):
            tokens.append(rng.randrange(vocab))
            extra = [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3]))]
            k = rng.randint(1, 8)
            assert index.propose(tokens, extra, k) == brute_force(tokens, extra, k, min_n, max_n)


class CountingTokens(list):
    """A sequence's tokens that count the reads of single positions and of slices."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.read = 0

    def __getitem__(self, at):
        self.read += 1
        return super().__getitem__(at)


def test_a_lookup_reads_only_the_tokens_added_since_the_last():
    tokens = CountingTokens(random.Random(1).randrange(50) for _ in range(5000))
    index = NgramIndex(2, 4)
    index.update(tokens)
    assert tokens.read == 4998  # a slice for each position but the first two
    tokens.read = 0
    tokens.append(7)
    index.propose(tokens, [], 4)
    # the new position, the last tokens, at most `CANDIDATES` matches compared back three tokens each, and what
    # followed the best: the 5,000 tokens before are not read again
    assert tokens.read <= 1 + 1 + CANDIDATES * 3 + 1


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


class NoGrammar:
    """Forces 90 (the grammar's only choice), then 91 (one split of the forced text among others)."""

    def forced(self, matcher, limit):
        return [90, 91][:limit], min(limit, 1)

    def valid(self, matcher, tokens):
        return len(tokens)


def price(token: float) -> Prices:
    """A step's prices where a row carrying drafts costs no more than their tokens (a GPU's)."""
    return Prices(token, 0.0)


def sequence(prompt: list[int], **params) -> Sequence:
    """A speculating sequence whose records start at half its drafts kept."""
    seq = fresh(prompt, **params)
    seq.copied_record, seq.forced_record = Record(1.0, 2.0), Record(1.0, 2.0)
    return seq


def fresh(prompt: list[int], **params) -> Sequence:
    """A speculating sequence that has not drafted yet: its records come from its engine's."""
    seq = Sequence(Request("r", prompt, SamplingParams(max_new_tokens=16, **params)), 1)
    seq.ngram = NgramIndex(2, 4)
    return seq


def test_drafts_stop_before_an_end_and_a_grammar_waiting_for_its_think_block():
    eos, closing = 2, 99
    drafter = Drafter(NoGrammar(), {eos}, closing)
    assert drafter.propose(sequence([5, 6, 7, eos, 8, 5, 6]), 8, price(100.0)) == [7]
    assert drafter.propose(sequence([5, 6, 7, eos, 8, 5, 6], ignore_eos=True), 8, price(100.0)) == [7, eos, 8, 5, 6, 7]
    waiting = sequence([5, 6, closing, 8, 5, 6])
    waiting.matcher = object()  # a grammar that starts after `</think>`
    assert drafter.propose(waiting, 8, price(100.0)) == []
    waiting.constrained = True  # now it constrains: its forced text first, then the sequence's own n-grams
    assert drafter.propose(waiting, 8, price(100.0))[:2] == [90, 91] and (waiting.certain, waiting.forced) == (1, 1)
    waiting.forced_record.fold(0, 100)  # a model that never splits forced text that way: only the certain token
    assert drafter.propose(waiting, 8, price(10.0))[:1] == [90] and (waiting.certain, waiting.forced) == (1, 0)


def test_a_sequences_record_sets_how_many_ngram_drafts_are_worth_proposing():
    drafter = Drafter(None, set(), None)
    seq = sequence(list(range(10, 30)) * 2)  # everything repeats: up to `cap` tokens to propose
    assert len(drafter.propose(seq, 8, price(100.0))) == 6  # accepted half the time at first: 0.5 ** 6 * 100 > 1
    assert len(drafter.propose(seq, 8, price(3.0))) == 1
    for _ in range(20):
        drafter.record(seq, 6, 6)  # every draft accepted
    assert len(drafter.propose(seq, 8, price(3.0))) == 8
    for _ in range(20):
        drafter.record(seq, 6, 0)  # the first rejected each time
    assert drafter.propose(seq, 8, price(3.0)) == []
    # each kind its own record: a certain draft, two other forced ones accepted, then the first n-gram one rejected
    seq.certain, seq.forced = 1, 2
    copied, forced = (seq.copied_record.hits, seq.copied_record.tries), (seq.forced_record.hits, seq.forced_record.tries)
    drafter.record(seq, 6, 3)
    assert (seq.copied_record.hits, seq.copied_record.tries) == pytest.approx((0.8 * copied[0], 0.8 * copied[1] + 1))
    assert (seq.forced_record.hits, seq.forced_record.tries) == pytest.approx((0.8 * forced[0] + 2, 0.8 * forced[1] + 2))
    seq.certain, seq.forced = 0, 3  # the second of three forced drafts rejected: the n-gram ones were never reached
    drafter.record(seq, 6, 1)
    assert seq.forced_record.tries == pytest.approx(0.8 * (0.8 * forced[1] + 2) + 2)
    assert seq.copied_record.tries == pytest.approx(0.8 * copied[1] + 1)  # unchanged: nothing it can tell


def test_a_sequence_with_nothing_to_copy_looks_up_less_and_less_often(monkeypatch):
    drafter = Drafter(None, set(), None)
    seq = sequence(list(range(100, 140)))  # nothing repeats
    lookups = []
    propose = NgramIndex.propose
    monkeypatch.setattr(NgramIndex, "propose", lambda self, *a: lookups.append(1) or propose(self, *a))
    weighed = []
    expected = Drafter._expected
    monkeypatch.setattr(Drafter, "_expected", lambda self, *a: weighed.append(1) or expected(self, *a))
    for token in range(200, 300):  # a hundred steps of output that repeats nothing
        assert drafter.propose(seq, 8, price(100.0)) == []
        seq.token_ids.append(token)
    assert len(lookups) < 20  # waits of 1, 2, ... 8 steps between lookups after each miss
    assert len(weighed) == len(lookups)  # a step it waits costs no pricing either
    seq.token_ids += seq.token_ids[-6:]  # now it repeats itself: drafts again within the longest wait
    found = [drafter.propose(seq, 8, price(100.0)) for _ in range(9)]
    assert any(found)


def test_a_rows_drafts_go_in_only_when_they_are_worth_their_row_too():
    """Where a row verifying drafts costs more than a decode row (a CPU: its drafts' own attention), a row
    carries drafts only when those it is expected to keep pay for the row as well as for their tokens."""
    drafter = Drafter(None, set(), None)
    seq = sequence(list(range(10, 30)) * 2)
    assert len(drafter.propose(seq, 8, Prices(3.0, 0.0))) == 1  # kept half the time: worth 1.5 tokens, costs 1
    assert drafter.propose(seq, 8, Prices(3.0, 2.0)) == []  # the row costs two tokens more
    for _ in range(20):
        drafter.record(seq, 6, 6)  # a sequence that copies: nearly every draft kept
    assert len(drafter.propose(seq, 8, Prices(3.0, 2.0))) == 8


def test_the_step_cost_fit_learns_what_a_row_verifying_drafts_costs():
    """A row with drafts costs 2 ms beyond its tokens here: the fit finds it, apart from a decode row's 0.5 ms."""
    cost = StepCost()
    rng = random.Random(3)
    for _ in range(300):
        rows = rng.randrange(1, 40)
        draft_rows = rng.randrange(0, min(rows, 6))
        work = Work(prefill_tokens=3 * draft_rows, decode_rows=rows, decode_longest=500, draft_rows=draft_rows)
        cost.observe(work, 0.004 + 5e-4 * rows + 1e-4 * work.prefill_tokens + 2e-3 * draft_rows)
    assert cost.coefficients["step_per_draft_row_s"] == pytest.approx(2e-3, rel=0.1)
    work = Work(prefill_tokens=9, decode_rows=20, decode_longest=500, draft_rows=3)
    assert cost.predict(work) == pytest.approx(0.004 + 5e-4 * 20 + 9e-4 + 6e-3, rel=0.05)


def test_a_new_sequence_starts_from_the_engines_record_which_comes_back_to_trying_now_and_then():
    """A sequence's first drafts are judged by what its engine's sequences kept so far: a new engine tries them
    (an optimistic start), an engine whose drafts were rejected proposes none where a row costs more than its
    tokens, and after enough new sequences tries again."""
    repeating = list(range(10, 30)) * 2
    drafter = Drafter(None, set(), None)
    assert len(drafter.propose(fresh(repeating), 8, Prices(3.0, 2.0))) > 1  # a new engine: tried
    for _ in range(40):
        seq = fresh(repeating)
        drafter.propose(seq, 8, Prices(3.0, 0.0))
        drafter.record(seq, 6, 0)  # the first draft rejected each time
    assert drafter.propose(fresh(repeating), 8, Prices(3.0, 2.0)) == []
    for _ in range(int(3 / RETRY)):  # new sequences that draft nothing
        drafter.propose(fresh(list(range(100, 140))), 8, Prices(3.0, 2.0))
    assert drafter.propose(fresh(repeating), 8, Prices(3.0, 2.0)) != []

