"""The drafts a grammar gives (engine.core.drafts): the tokens of the text it forces next, and how many of them
are certain.

xgrammar reads the text a matcher's grammar forces from where it stands (`find_jump_forward_string`, about a
microsecond, and empty inside a string's free text) and splits it into the longest tokens that spell it
(`find_jump_forward_tokens`, which leaves out a last token that a longer token could extend past the forced
text). A token of that split is certain when no other token spells a shorter or longer start of the forced text
left where it stands: the vocabulary's spellings, as a set, answer that in a few lookups per token, where filling
the grammar's mask to count the tokens it allows would take tens of microseconds on a 150k vocabulary. A model
under the grammar can only write a certain token; the other tokens of the split are what a model writes that
splits text the way its tokenizer does, and a model that splits it otherwise rejects some.
"""

from __future__ import annotations

import xgrammar as xgr


class ForcedDrafts:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        special = set(info.special_token_ids)
        self.pieces = info.decoded_vocab  # token -> its bytes
        self.spellings = {piece for token, piece in enumerate(self.pieces) if token not in special and piece}
        self.longest = max(map(len, self.spellings))

    def forced(self, matcher: xgr.GrammarMatcher, limit: int) -> tuple[list[int], int]:
        """At most `limit` tokens of the text the grammar forces next, and how many of them, leading, are each
        the only token the grammar allows where it stands."""
        text = matcher.find_jump_forward_string() if limit > 0 else ""
        if not text:
            return [], 0
        tokens = matcher.find_jump_forward_tokens()[:limit]
        return tokens, self.certain(text.encode(), tokens)

    def certain(self, text: bytes, tokens: list[int]) -> int:
        """How many leading `tokens`, which spell the start of the forced `text` in turn, are each the one token
        that fits where it stands."""
        at = 0
        for n, token in enumerate(tokens):
            piece, rest = self.pieces[token], text[at:]
            if any(rest[:i] in self.spellings for i in range(1, min(len(rest), self.longest) + 1) if i != len(piece)):
                return n  # another token spells a start of the forced text
            at += len(piece)
        return len(tokens)

    def valid(self, matcher: xgr.GrammarMatcher, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar accepts in turn; the matcher is left as it was."""
        accepted = 0
        for token in tokens:
            if not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return accepted
