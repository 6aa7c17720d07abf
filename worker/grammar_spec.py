"""The grammar a job's answer follows (`engine.interface.GrammarSpec`), from its `response_format` and its tools.

- `json_schema` / `json_object`: JSON in that format (`json_object`: any JSON object);
- `tool_choice` `required`: one or more calls of the job's tools (one, without `parallel_tool_calls`) and
  nothing else;
- a named function: exactly one call of it;
- `auto`: free text, no grammar (parsed afterwards), unless the job also has a `response_format`: then the
  answer is either tool calls or JSON in that format, as OpenAI's is;
- `none`: the tools are not shown and the `response_format`, if any, is the grammar alone.
With `required` or a named function, a `response_format` has no say: the answer is the call (OpenAI's format applies
to the answer the model writes once the tool's result is back). The arguments follow the tool's `parameters`;
with none, or with `strict: false`, they are any JSON object.

Each schema is written here as JSON text once (compact, so that one schema sent twice is one spec, the engine
caching compiled grammars by spec; keys not sorted, so that the answer keeps the client's order of properties) and
goes to the grammar compiler as it is.
"""

from __future__ import annotations

import json

from engine.interface import ANY_OBJECT, GrammarKind, GrammarSpec, ToolSchema
from jobs.schemas import JobIn, NamedToolChoice, ResponseFormat, Tool
from jobs.tool_calls import offers_tools


def grammar_spec(job: JobIn) -> GrammarSpec | None:
    """The grammar of `job`'s answer; None where nothing constrains it (see the module's doc)."""
    if not offers_tools(job.tools, job.tool_choice):
        answer = _answer_schema(job.response_format)
        return None if answer is None else GrammarSpec(GrammarKind.JSON_SCHEMA, schema=answer)
    choice = job.tool_choice or "auto"
    if isinstance(choice, NamedToolChoice):
        named = next(tool for tool in job.tools if tool.function.name == choice.function.name)
        return GrammarSpec(GrammarKind.FORCED_CALL, tools=(_tool_schema(named),))
    if choice == "required":
        return GrammarSpec(GrammarKind.CALLS, tools=_tool_schemas(job), parallel_calls=job.parallel_tool_calls)
    answer = _answer_schema(job.response_format)  # `auto`: free, or a call or the answer in its format
    if answer is None:
        return None
    return GrammarSpec(GrammarKind.CALLS_OR_JSON, schema=answer, tools=_tool_schemas(job),
                       parallel_calls=job.parallel_tool_calls)


def _answer_schema(response_format: ResponseFormat | None) -> str | None:
    """The schema of the answer's format as JSON text; None (free text) for `text` or none."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_OBJECT
    return _text(response_format.json_schema.schema_)


def _tool_schemas(job: JobIn) -> tuple[ToolSchema, ...]:
    return tuple(_tool_schema(tool) for tool in job.tools)


def _tool_schema(tool: Tool) -> ToolSchema:
    function = tool.function
    free = function.parameters is None or function.strict is False
    return ToolSchema(function.name, ANY_OBJECT if free else _text(function.parameters))


def _text(schema: dict) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
