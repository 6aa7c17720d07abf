"""Generated token ids to text: decoding, EOS and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from engine.interface import cut_at_stop


def stop_window(stops: Sequence[str]) -> int:
    """Tokens at the end of an output that a stop string completed by its last token can span: a byte-level
    tokenizer's tokens hold at least one byte each, so no more tokens than the stop string has bytes."""
    return max((len(s.encode()) for s in stops if s), default=1)


def stop_ends(stops: Sequence[str]) -> frozenset[str]:
    """The characters of which a token's text must hold one if that token can complete a stop string (the step
    loop asks `not stop_ends(stops).isdisjoint(token_text)`): a stop's last character, or, where that character
    is not ASCII, U+FFFD, which bytes of a character split over tokens decode to alone (an ASCII byte always
    decodes to itself). A token with no text (a special token, skipped) completes nothing."""
    ends = {s[-1] for s in stops if s}
    split = {"\ufffd"} if any(not c.isascii() for c in ends) else set()
    return frozenset(ends | split)


def stops_hit(tokenizer, tails: list[tuple[list[int], Sequence[str]]]) -> list[bool]:
    """For each (last tokens of an output, at least `stop_window` of them; its stop strings): whether a stop
    string ends with the output's last token. Only these tails are decoded, all in one call, instead of every
    output from its start every token; earlier occurrences were caught when they ended."""
    texts = tokenizer.backend_tokenizer.decode_batch([ids for ids, _ in tails], skip_special_tokens=True)
    return [cut_at_stop(text, stops)[1] for text, (_, stops) in zip(texts, tails, strict=True)]


def finish_text(tokenizer, token_ids: list[int], stops: Sequence[str], eos_ids: set[int]) -> tuple[list[int], str, bool]:
    """Generated ids and text trimmed at EOS or the first stop string; the bool says whether either hit."""
    ended = False
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            token_ids, ended = token_ids[:i], True
            break
    text, stopped = cut_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stops)
    if stopped:
        token_ids = token_ids[:shortest_stopped(tokenizer, token_ids, stops)]
    return token_ids, text, ended or stopped


def shortest_stopped(tokenizer, token_ids: list[int], stops: Sequence[str]) -> int:
    """The fewest leading tokens of `token_ids` (whose text holds a stop string) whose text holds one.

    A prefix's text is the start of a longer prefix's (but for a character whose bytes are split, which decodes
    to U+FFFD until its last byte), so holding a stop string is monotone in the prefix's length: the count is
    found by galloping back from the end, then bisecting, a decode per probe. An output whose stop string ends
    with its last token, as the engine's step loop finishes every one, costs a single decode besides its text;
    decoding every prefix cost 1.5 s of the step loop for an output of 4,000 tokens."""
    def holds(n: int) -> bool:
        return cut_at_stop(tokenizer.decode(token_ids[:n], skip_special_tokens=True), stops)[1]

    hi, back = len(token_ids), 1  # `hi` holds one
    while hi - back > 0 and holds(hi - back):
        hi, back = hi - back, 2 * back
    lo = max(0, hi - back)  # `lo` holds none (no text holds none either)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


THINK_TAGS = ("<think>", "</think>")


def think_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of a thinking model's `<think>` and `</think>` tokens, when its vocabulary has both."""
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in THINK_TAGS]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        return None
    return ids[0], ids[1]
