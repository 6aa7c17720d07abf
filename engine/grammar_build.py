"""The xgrammar grammar a `GrammarSpec` describes.

JSON is compiled without free whitespace (one space after `:` and `,`, none elsewhere): a model may not spend
its budget on blanks, so an output of a bounded schema completes within a modest budget. Tool calls are a
structural tag (`engine.grammar_tags`). Each schema's text goes to xgrammar as it came in the spec.
"""

from __future__ import annotations

import xgrammar as xgr

from engine.grammar_tags import structural_tag
from engine.interface import GrammarKind, GrammarSpec

JSON_SEPARATORS = (", ", ": ")
# xgrammar 0.2.9 draws a JSON string's characters as `[^"\\\r\n]` (strings with a length bound: raw control
# characters allowed) or `[^\0-\x1f"\\\r\n]`, and either takes the UTF-8 bytes of a surrogate (U+D800..U+DFFF),
# which no UTF-8 decoder does (json.loads refuses the first, and a byte-level tokenizer's output would decode to
# U+FFFD). Each becomes JSON's own class of plain characters, without surrogates.
LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
JSON_STRING_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'


def grammar_of(spec: GrammarSpec) -> xgr.Grammar:
    """The grammar `spec` describes; raises xgrammar's errors (RuntimeError, ValueError) for one it cannot be."""
    if spec.kind is GrammarKind.JSON_SCHEMA:
        grammar = xgr.Grammar.from_json_schema(spec.schema, any_whitespace=False, separators=JSON_SEPARATORS)
    else:
        grammar = xgr.Grammar.from_structural_tag(structural_tag(spec))
    text = str(grammar)
    if not any(loose in text for loose in LOOSE_STRING_CHARS):
        return grammar
    for loose in LOOSE_STRING_CHARS:
        text = text.replace(loose, JSON_STRING_CHAR)
    return xgr.Grammar.from_ebnf(text)
