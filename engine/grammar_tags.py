"""Tool calls as an xgrammar structural tag, in Qwen3's format: `<tool_call>` blocks of a request's tools.

- `CALLS`: one or more blocks (one without `parallel_calls`), separated by a newline, and nothing else
  (xgrammar's own `required` lets free text follow the calls, which a model may then write until its budget
  runs out);
- `FORCED_CALL`: exactly one block of the one tool;
- `CALLS_OR_JSON`: the blocks as under `CALLS`, or JSON that follows the spec's schema.
The tag is written as JSON text with each schema's text placed in it as it is, so no schema is parsed on the
way to the compiler. It holds no reasoning part: with thinking, the grammar starts after the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from engine.interface import GrammarKind, GrammarSpec, ToolSchema

# a block as Qwen3 writes it (xgrammar's `qwen_3` model tag): the JSON of the call, arguments last
CALL_BEGIN = '<tool_call>\n{{"name": {name}, "arguments": '
CALL_END = "}\n</tool_call>"
# JSON in a structural tag cannot be compiled without whitespace (the engine's own JSON can): at most one blank
# in a row, so that a model cannot spend its budget on blanks
MAX_BLANKS = 1


def structural_tag(spec: GrammarSpec) -> str:
    """The structural tag of a spec with tool calls, as xgrammar's `Grammar.from_structural_tag` takes it."""
    if spec.kind is GrammarKind.FORCED_CALL:
        form = _call(spec.tools[0])
    else:
        form = _object(type='"tags_with_separator"', tags=_array(_call(tool) for tool in spec.tools),
                       separator=json.dumps("\n"), at_least_one="true",
                       stop_after_first=json.dumps(not spec.parallel_calls))
    if spec.kind is GrammarKind.CALLS_OR_JSON:  # a call, or the answer in its format
        form = _object(type='"or"', elements=_array([form, _json(spec.schema)]))
    return _object(type='"structural_tag"', format=form)


def _call(tool: ToolSchema) -> str:
    begin = CALL_BEGIN.format(name=json.dumps(tool.name, ensure_ascii=False))  # the name as a JSON string
    return _object(type='"tag"', begin=json.dumps(begin, ensure_ascii=False),
                   content=_json(tool.parameters), end=json.dumps(CALL_END))


def _json(schema: str) -> str:
    return _object(type='"json_schema"', json_schema=schema, max_whitespace_cnt=str(MAX_BLANKS))


def _object(**members: str) -> str:
    """A JSON object of members whose values are JSON text already."""
    return "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in members.items()) + "}"


def _array(items: Iterable[str]) -> str:
    return "[" + ",".join(items) + "]"
