"""Draft tokens from a sequence's own tokens: where its last tokens appeared before, what followed them then.

A summary copies names, numbers and phrases from its transcript, a record its keys and punctuation, so the
tokens after an earlier occurrence of the output's last few tokens are often the next ones. The index maps each
`min_n`-gram of the sequence (prompt and output) to where it last ended, and chains every end to the end before
it of the same n-gram, so a lookup reads the most recent occurrences first without scanning the history. Of
those it keeps the one whose match, extended backwards, is longest (up to `max_n` tokens; the most recent on a
tie) and proposes the tokens that followed it; where those run into the end of the sequence (a loop: its last
tokens repeat what came just before them) the proposal goes on repeating that period. The index is brought up
to date as it is read, a token at a time, so a step that proposes nothing pays nothing for the tokens it did
not look at.
"""

from __future__ import annotations

from array import array

CANDIDATES = 8  # occurrences of the last `min_n` tokens compared backwards, the most recent first


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min <= max, not {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}  # a min_n-gram -> the latest position it ends at (exclusive)
        self.before = array("i")  # position -> the previous end of the n-gram ending there, -1 for none
        self.indexed = 0  # positions below this are in `before` (those before `min_n` with -1)

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram of `tokens` that has a token after it (the sequence only ever grows)."""
        last, before, n = self.last, self.before, self.min_n
        for end in range(self.indexed, len(tokens)):
            if end < n:
                before.append(-1)
                continue
            key = tuple(tokens[end - n:end])
            before.append(last.get(key, -1))
            last[key] = end
        self.indexed = len(tokens)

    def propose(self, tokens: list[int], extra: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `tokens + extra` (`extra`: drafts already chosen, not yet part of the
        sequence), copied from after the best earlier occurrence of its last tokens; [] when none matches."""
        if k <= 0:
            return []
        self.update(tokens)
        tail = (tokens[-self.max_n:] + extra)[-self.max_n:] if extra else tokens[-self.max_n:]
        if len(tail) < self.min_n:
            return []
        end = self.last.get(tuple(tail[-self.min_n:]), -1)
        best, best_len = -1, 0
        for _ in range(CANDIDATES):
            if end < 0:
                break
            length = self.min_n
            while (length < len(tail) and length < end
                   and tokens[end - length - 1] == tail[-length - 1]):
                length += 1
            if length > best_len:
                best, best_len = end, length
                if length == len(tail):
                    break
            end = self.before[end]
        if best < 0:
            return []
        n, m = len(tokens), len(extra)
        proposed = tokens[best:best + k]
        for i in range(len(proposed), k):  # past the end: the same period again
            at = best + i
            proposed.append(extra[at - n] if at < n + m else proposed[at - n - m])
        return proposed
