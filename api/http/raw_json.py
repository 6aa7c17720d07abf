"""JSON text with values put in as the database stored them, never parsed.

A result's log-probabilities can be tens of megabytes of JSON (`n` 8, `top_logprobs` 20, 4,096 tokens: ~30 MB);
parsed into Python objects and validated, they took ten times that. They are stored as OpenAI's
`logprobs.content` already, so an answer carries their stored text as it is: `hold` gives a placeholder to put
where the value goes, and `parts` the serialized text cut at each placeholder with the held text in its place.
A value may also be held as its length alone, which is all that sizing the text (`size`) needs.

A placeholder is a string with NUL characters and a per-object nonce in it; PostgreSQL's text never holds NUL,
so no string read from the database serializes the same.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator


class Spliced:
    def __init__(self) -> None:
        self._nonce = uuid.uuid4().hex[:12]
        self._held: list[str | int] = []
        # json.dumps writes NUL as \u0000 and a placeholder's quotes around it
        self._placeholder = re.compile(rf'"\\u0000{self._nonce}:(\d+)\\u0000"')

    def hold(self, stored: str | int) -> str:
        """A placeholder for a JSON value: its stored text, or (to size the text only) its length in bytes."""
        self._held.append(stored)
        return f"\x00{self._nonce}:{len(self._held) - 1}\x00"

    def parts(self, value: object) -> Iterator[str | int]:
        """`value` as JSON text, in pieces: the serialized text between placeholders, and each held value."""
        for i, piece in enumerate(self._placeholder.split(json.dumps(value))):
            yield piece if i % 2 == 0 else self._held[int(piece)]

    def encoded(self, value: object) -> Iterator[bytes]:
        """`value` as UTF-8 JSON, a piece at a time (every held value must be text)."""
        for piece in self.parts(value):
            if isinstance(piece, int):
                raise TypeError("a length was held where the text is wanted")
            yield piece.encode()

    def size(self, value: object) -> int:
        """The length in bytes of `value` as UTF-8 JSON."""
        return sum(piece if isinstance(piece, int) else len(piece.encode()) for piece in self.parts(value))
