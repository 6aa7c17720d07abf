"""A completion's log-probabilities in OpenAI's shape (`logprobs.content`), as a job's result stores them."""

from __future__ import annotations

from collections.abc import Sequence

from engine.interface import Completion

# what OpenAI writes for a token with no chance at all (one the grammar rules out), since JSON has no -Infinity
FLOOR = -9999.0


def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards (Qwen's tokenizers spell tokens in it): each character's byte.
    Printable bytes stand for themselves; the rest are shifted past U+00FF, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


BYTE_OF = _byte_of()


def token_pieces(tokenizer: object, token_ids: Sequence[int]) -> dict[int, tuple[str, list[int]]]:
    """Each token's text and bytes. A byte-level token's bytes are exact (a character may span tokens: its
    text then holds U+FFFD, as the tokenizer decodes it); a token spelled otherwise is its decoded text."""
    unique = list(dict.fromkeys(token_ids))
    pieces = {}
    for token_id, token in zip(unique, tokenizer.convert_ids_to_tokens(unique), strict=True):
        if token and all(char in BYTE_OF for char in token):
            raw = bytes(BYTE_OF[char] for char in token)
            pieces[token_id] = raw.decode("utf-8", errors="replace"), list(raw)
        else:
            text = tokenizer.decode([token_id])
            pieces[token_id] = text, list(text.encode())
    return pieces


def answer_start(tokenizer: object, token_ids: Sequence[int], thinking: bool) -> int:
    """Where the answer's tokens begin: with thinking, after the reasoning's `</think>`. A reasoning never closed
    leaves no answer, and an output without a think block is all answer, as `jobs.chat.split_reasoning` reads
    the text."""
    if not thinking:
        return 0
    close, opened = tokenizer.convert_tokens_to_ids(["</think>", "<think>"])
    if close in token_ids:
        return token_ids.index(close) + 1
    return len(token_ids) if opened in token_ids else 0


def openai_logprobs(tokenizer: object, completion: Completion, thinking: bool) -> list[dict] | None:
    """OpenAI's `logprobs.content` of the completion's answer, or None when its request asked for none.

    With thinking, only the answer's tokens (after `</think>`) are listed, as the result's text is the answer:
    the reasoning is no part of what OpenAI's logprobs describe."""
    if completion.logprobs is None:
        return None
    start = answer_start(tokenizer, completion.token_ids, thinking)
    ids, entries = completion.token_ids[start:], completion.logprobs[start:]
    pieces = token_pieces(tokenizer, [*ids, *(alt for _, alts in entries for alt, _ in alts)])

    def entry(token_id: int, logprob: float) -> dict:
        text, raw = pieces[token_id]
        return {"token": text, "logprob": max(logprob, FLOOR), "bytes": raw}

    return [{**entry(token_id, logprob), "top_logprobs": [entry(alt, alt_logprob) for alt, alt_logprob in alts]}
            for token_id, (logprob, alts) in zip(ids, entries, strict=True)]
