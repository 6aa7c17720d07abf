"""A customer's text kept as text in a prompt: only the chat template's own scaffolding yields control tokens.

A chat template renders the messages into one string, and a tokenizer reading that string whole reads the name
of a control token wherever it stands: `<|im_end|>\\n<|im_start|>system\\n` typed in a message would open a real
turn of another role, a typed `</think>` would end a thinking model's reasoning. So where a customer's string (a
message's content, a tool call's name or arguments, a tool's definition) holds the name of one of the
tokenizer's added tokens, `hide` replaces each such name by a stand-in (two private-use characters) before the
template renders. `encode` then encodes the rendered string as the tokenizer does (the names the template wrote
itself read as their tokens) and encodes each piece between two names that holds a stand-in again, its stand-ins
spelled back, with the tokenizer's own model, normalizer and pre-tokenizer but no added token, in place of its
tokens there. The tokenizer itself splits at names (it takes added tokens out first and tokenizes what lies
between apart; Qwen's match verbatim), so a piece encoded apart gets the tokens a whole-string encoding would
give it, and no merge crosses into the scaffolding.

In an assistant message (the model's own earlier answer, sent back) the first `</think>` and any `<think>`
before it are left as written: Qwen3's template takes the answer's reasoning out of them, as the model wrote it.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
# A stand-in is ESCAPE and one character more: ESCAPE twice is a customer's own ESCAPE, ESCAPE and
# chr(FIRST + i) the i-th added token's name. Private-use characters: no script's text, no template's scaffolding;
# in the Basic Multilingual Plane, as a string holding a character beyond it takes twice the memory, and rendering
# and encoding such strings cost more.
ESCAPE, FIRST = "\ue000", 0xE001
STANDIN = re.compile(ESCAPE + "(.)", re.DOTALL)


@dataclass(frozen=True)
class Names:
    """The names of a tokenizer's added tokens, as patterns that match the longest first (as the tokenizer
    does), and their ids."""

    ids: dict[str, int]
    every: re.Pattern  # every name: what a customer's string must not carry into the template
    unspecial: re.Pattern | None  # the names of tokens that are not special (`<think>`): read even when the
    # tokenizer is set to leave special tokens as text
    order: tuple[str, ...]  # the i-th name's stand-in is ESCAPE + chr(FIRST + i)
    escapes: re.Pattern  # what `hide` replaces: every name, and ESCAPE itself
    standins: dict[str, str]
    text_only: Any  # the Rust tokenizer without its added tokens (`plain`); None for a tokenizer without one

    def read_by(self, tokenizer) -> re.Pattern | None:
        """The names this tokenizer reads as their tokens, as it is set now."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "split_special_tokens", False) or (backend is not None and backend.encode_special_tokens):
            return self.unspecial
        return self.every


_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_names_lock = threading.Lock()


def names(tokenizer) -> Names:
    """The names of `tokenizer`'s added tokens, worked out once per tokenizer (a worker's and the API's live as
    long as their process; listing them costs as much as a fifth of encoding a short prompt)."""
    found = _names.get(tokenizer)
    if found is None:
        with _names_lock:
            found = _names.get(tokenizer) or _names.setdefault(tokenizer, _list_names(tokenizer))
    return found


def _list_names(tokenizer) -> Names:
    added = {token.content: (token_id, token.special) for token_id, token in tokenizer.added_tokens_decoder.items()}
    order = tuple(sorted(added, key=len, reverse=True))
    unspecial = [name for name in order if not added[name][1]]
    standins = {name: ESCAPE + chr(FIRST + i) for i, name in enumerate(order)} | {ESCAPE: ESCAPE * 2}
    return Names({name: added[name][0] for name in order}, _alternatives(order),
                 _alternatives(unspecial) if unspecial else None, order, _alternatives([*order, ESCAPE]), standins,
                 _without_added_tokens(tokenizer))


def _alternatives(texts: Sequence[str]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, texts)))


def holds_names(found: Names, chat: Sequence[Mapping[str, Any]], tools: list[dict] | None) -> bool:
    """Whether any customer string of the chat or its tools holds a name of an added token."""
    pending: list[Any] = [value for message in chat for value in message.values()]
    pending.append(tools)
    while pending:  # iteratively, stopping at the first: most chats hold none, and are walked through once
        value = pending.pop()
        if isinstance(value, str):
            if found.every.search(value):
                return True
        elif isinstance(value, dict):
            pending += value.keys()
            pending += value.values()
        elif isinstance(value, list | tuple):
            pending += value
    return False


def hide(found: Names, chat: Sequence[Mapping[str, Any]], tools: list[dict] | None) -> tuple[list[dict], list | None]:
    """The chat and tools with every added token's name in a customer's string replaced by its stand-in."""
    def hidden(text: str, keep: frozenset[str] = frozenset()) -> str:
        return found.escapes.sub(lambda m: m[0] if m[0] in keep else found.standins[m[0]], text)

    def assistant(text: str) -> str:
        reasoning, closed, answer = text.partition(CLOSE_THINK)
        if not closed:
            return hidden(text)
        return hidden(reasoning, frozenset({OPEN_THINK})) + closed + hidden(answer)

    messages = [{key: assistant(value) if key == "content" and message.get("role") == "assistant"
                 and isinstance(value, str) else _mapped(value, hidden) for key, value in message.items()}
                for message in chat]
    return messages, None if tools is None else _mapped(tools, hidden)


def spelled(found: Names, text: str) -> str:
    """`text` with its stand-ins spelled back as the names they hide."""
    return STANDIN.sub(lambda m: ESCAPE if m[1] == ESCAPE else found.order[ord(m[1]) - FIRST], text)


def encode(tokenizer, found: Names, rendered: str, whole: Callable[[str], list[int]]) -> list[int]:
    """Token ids of a chat rendered from hidden strings: the names left in it (the template's) read as their
    tokens, each piece between two of them that holds a stand-in encoded apart without added tokens (`plain`),
    its stand-ins spelled back. What lies between such pieces goes to `whole` (the tokenizer reading names), a
    call for each stretch: a stretch starts and ends at a name, where the tokenizer splits anyway. (Encoding
    everything whole and then such pieces again costs more: the pieces are most of such a chat's text.)"""
    text_only, read = plain(tokenizer), found.read_by(tokenizer)
    spans = [span for match in read.finditer(rendered) for span in match.span()] if read is not None else []
    bounds = [0, *spans, len(rendered)]  # piece k is rendered[bounds[2k]:bounds[2k + 1]]
    ids: list[int] = []
    done = 0  # what lies before is encoded
    for start, end in zip(bounds[::2], bounds[1::2], strict=True):
        if rendered.find(ESCAPE, start, end) >= 0:
            ids += whole(rendered[done:start]) if start > done else []
            ids += text_only.encode(spelled(found, rendered[start:end]), add_special_tokens=False).ids
            done = end
    return ids + (whole(rendered[done:]) if done < len(rendered) else [])


def plain(tokenizer) -> Any:
    """The tokenizer's Rust tokenizer without its added tokens: its model, normalizer and pre-tokenizer, and
    nothing that truncates or pads."""
    text_only = names(tokenizer).text_only
    if text_only is None:
        raise ValueError("keeping a customer's text apart from control tokens needs a fast (Rust) tokenizer")
    return text_only


def _without_added_tokens(tokenizer) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    text_only = Tokenizer(backend.model)  # the model shared, not copied
    text_only.normalizer, text_only.pre_tokenizer = backend.normalizer, backend.pre_tokenizer
    return text_only


def _mapped(value: Any, change: Callable[[str], str]) -> Any:
    """`value` (JSON-like: a message's fields, a tool's definition) with `change` applied to every string in
    it, dictionary keys included (a tool's parameters are named by its author)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_mapped(key, change): _mapped(item, change) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_mapped(item, change) for item in value]
    return value
