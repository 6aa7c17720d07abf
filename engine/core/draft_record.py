"""How often drafts of one kind have been accepted, by a sequence or by the engine's sequences together, and so
how many of them a step should carry.

Verification is sequential (a draft counts only if every draft before it was accepted), so a record counts the
drafts that were reached and, of those, the ones accepted, each verified row's counts weighing `DECAY` times
the row's before it, from a prior. Its rate is the chance that the next draft is accepted given the ones before
it were; the j-th draft in a row is accepted with that chance to the power j.
"""

from __future__ import annotations

import math

DECAY = 0.8  # a verified row's weight in a sequence's record against the row's before it


class Record:
    __slots__ = ("decay", "hits", "tries")

    def __init__(self, prior_hits: float, prior_tries: float, decay: float = DECAY) -> None:
        self.hits, self.tries, self.decay = prior_hits, prior_tries, decay

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def fold(self, hits: int, tries: int) -> None:
        """Count a verified row's drafts of this kind: `tries` reached, `hits` of them accepted."""
        self.hits = self.decay * self.hits + hits
        self.tries = self.decay * self.tries + tries

    def start(self, tries: float = 2.0) -> Record:
        """A new sequence's record: this one's rate, with the evidence of `tries` drafts."""
        return Record(self.rate * tries, tries)

    def relax(self, rate: float, share: float) -> None:
        """Move this record's rate `share` of the way towards `rate`, its evidence unchanged."""
        self.hits += share * (rate * self.tries - self.hits)

    def worth(self, value: float) -> int:
        """How many drafts in a row are worth proposing where an accepted one is worth `value` times its cost:
        the j-th is while rate ** j * value > 1."""
        if value <= 1:
            return 0
        return math.floor(math.log(value) / -math.log(self.rate)) if self.rate < 1 else 1 << 30
