"""How often a sequence's drafts of one kind have been accepted, and so how many of them a step should carry.

Verification is sequential (a draft counts only if every draft before it was accepted), so a record counts the
drafts that were reached and, of those, the ones accepted, each verified row's counts weighing `DECAY` times
the row's before it, from a prior. Its rate is the chance that the next draft is accepted given the ones before
it were; the j-th draft in a row is accepted with that chance to the power j.
"""

from __future__ import annotations

import math

DECAY = 0.8  # a verified row's weight in a record against the row's before it


class Record:
    __slots__ = ("hits", "tries")

    def __init__(self, prior_hits: float, prior_tries: float) -> None:
        self.hits, self.tries = prior_hits, prior_tries

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def fold(self, hits: int, tries: int) -> None:
        """Count a verified row's drafts of this kind: `tries` reached, `hits` of them accepted."""
        self.hits = DECAY * self.hits + hits
        self.tries = DECAY * self.tries + tries

    def worth(self, value: float) -> int:
        """How many drafts in a row are worth proposing where an accepted one is worth `value` times its cost:
        the j-th is while rate ** j * value > 1."""
        if value <= 1:
            return 0
        return math.floor(math.log(value) / -math.log(self.rate)) if self.rate < 1 else 1 << 30
