"""Constrained decoding with xgrammar: a request's grammar becomes a matcher that masks the tokens it forbids.

A grammar spec is JSON text, one of
- `{"type": "json_schema", "schema": {...}}`: an output that parses and validates against the schema;
- `{"type": "json_object"}`: any JSON object;
- `{"type": "structural_tag", "structural_tag": {...}}`: xgrammar's structural tag (tool calls; see
  `xgrammar.get_model_structural_tag`).
JSON is compiled without free whitespace (one space after `:` and `,`, none elsewhere): a model may not spend
its budget on blanks, so an output of a bounded schema completes within a modest budget.

Compiling happens on the submitting thread (`LLMEngine.prepare`) and compiled grammars are kept in an LRU keyed
by the spec, so a schema seen before costs a lookup. Each step, the loop fills the bitmasks of the rows that
sample under a grammar in one batched call (`masks`), which the sampler applies to the logits on their device
before penalties; rows without a grammar pay nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch
import xgrammar as xgr

from engine.interface import RequestError
from engine.step import TokenMasks

CACHED_GRAMMARS = 512  # compiled grammars kept (a few KB to a few MB each for a 150k vocabulary)
JSON_SEPARATORS = (", ", ": ")
# xgrammar 0.2.9 draws a JSON string's characters as `[^"\\\r\n]` (strings with a length bound: raw control
# characters allowed) or `[^\0-\x1f"\\\r\n]`, and either takes the UTF-8 bytes of a surrogate (U+D800..U+DFFF),
# which no UTF-8 decoder does (json.loads refuses the first, and a byte-level tokenizer's output would decode to
# U+FFFD). Each becomes JSON's own class of plain characters, without surrogates.
LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
JSON_STRING_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'


def _message(e: Exception) -> str:
    """xgrammar's error without its source location (`[time] path.cc:line: message`)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def grammar_of(spec: str) -> xgr.Grammar:
    """The grammar a spec describes; raises ValueError (or xgrammar's RuntimeError) for one it cannot be."""
    parsed = json.loads(spec)
    kind = parsed.get("type") if isinstance(parsed, dict) else None
    if kind == "json_schema":
        grammar = xgr.Grammar.from_json_schema(json.dumps(parsed["schema"]), any_whitespace=False,
                                               separators=JSON_SEPARATORS)
    elif kind == "json_object":
        grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                               separators=JSON_SEPARATORS)
    elif kind == "structural_tag":
        grammar = xgr.Grammar.from_structural_tag(json.dumps(parsed["structural_tag"]))
    else:
        raise ValueError(f"unknown grammar type {kind!r}")
    text = str(grammar)
    if not any(loose in text for loose in LOOSE_STRING_CHARS):
        return grammar
    for loose in LOOSE_STRING_CHARS:
        text = text.replace(loose, JSON_STRING_CHAR)
    return xgr.Grammar.from_ebnf(text)


class Grammars:
    """One model's grammar compiler, its cache, and the batched work of its matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Iterable[int], threads: int = 2) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()
        self.words = xgr.get_bitmask_shape(1, self.info.vocab_size)[1]
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # requests are prepared on any submitting thread

    def compiled(self, spec: str) -> xgr.CompiledGrammar:
        """`spec` compiled, from the cache when it was seen before; raises `RequestError` naming the problem."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        try:
            compiled = self.compiler.compile_grammar(grammar_of(spec))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise RequestError(f"grammar: {_message(e)}") from e
        with self._lock:
            self._compiled[spec] = compiled
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: str) -> xgr.GrammarMatcher:
        """A fresh matcher for `spec`."""
        return xgr.GrammarMatcher(self.compiled(spec))

    def masks(self, num_rows: int, rows: list[int], matchers: list[xgr.GrammarMatcher]) -> TokenMasks:
        """The next-token bitmasks of `matchers`, those of sample rows `rows` out of `num_rows`, filled in one
        call (the rows of the others are left as they are: the sampler never reads them)."""
        bitmask = torch.empty((num_rows, self.words), dtype=torch.int32)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return TokenMasks(rows, bitmask)
