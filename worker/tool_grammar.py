"""The grammar that enforces a job's `tool_choice`: an xgrammar structural tag in Qwen3's tool-call format.

- `required`: one or more `<tool_call>` blocks of the job's tools (one, without `parallel_tool_calls`),
  separated by a newline, and nothing else (xgrammar's own `required` lets free text follow the calls, which a
  model may then write until its budget runs out);
- a named function: exactly one call of it (xgrammar's `forced`);
- `auto`: free text, no grammar (parsed afterwards), unless the job also has a `response_format`: then the
  answer is either tool calls or JSON in that format, as OpenAI's is;
- `none`: the tools are not shown and the `response_format`, if any, is the grammar alone.
With `required` or a named function, a `response_format` has no say: the answer is the call (OpenAI's format applies
to the answer the model writes once the tool's result is back). The arguments follow the tool's `parameters`;
with none, or with `strict: false`, they are any JSON object. With thinking on, the grammar starts after the
reasoning (`SamplingParams.grammar_after_think`), so the tag holds no reasoning part.

Built in the worker only: xgrammar loads torch, which the API must not.
"""

from __future__ import annotations

import json

import xgrammar as xgr
from xgrammar.structural_tag import JSONSchemaFormat, OrFormat, StructuralTag, TagsWithSeparatorFormat

from jobs.schemas import JobIn, NamedToolChoice, Tool
from jobs.structured import grammar_spec
from jobs.tool_calls import offers_tools

MODEL_FORMAT = "qwen_3"  # the Qwen3 family's `<tool_call>` blocks (xgrammar's builtin_structural_tag)
ANY_OBJECT = {"type": "object"}
# JSON in a structural tag cannot be compiled without whitespace (the engine's own JSON can). At most one blank
# in a row is allowed, so that a model cannot spend its budget on blanks.
MAX_BLANKS = 1


def _grammar_tool(tool: Tool) -> dict:
    """The tool as the grammar needs it: its name and its arguments' schema (what describes it is the prompt's)."""
    function = tool.function
    parameters = ANY_OBJECT if function.parameters is None or function.strict is False else function.parameters
    return {"type": "function", "function": {"name": function.name, "parameters": parameters}}


def tool_grammar(job: JobIn) -> str | None:
    """The engine's grammar spec (`engine.grammar`, a structural tag) for the job's tool choice; None where its
    tools constrain nothing (see the module's doc)."""
    if not offers_tools(job.tools, job.tool_choice):
        return None
    choice, answer = job.tool_choice or "auto", grammar_spec(job.response_format)
    if choice == "auto" and answer is None:
        return None
    named = isinstance(choice, NamedToolChoice)
    tag = xgr.get_model_structural_tag(
        MODEL_FORMAT, tools=[_grammar_tool(tool) for tool in job.tools],
        tool_choice=choice.model_dump() if named else "required", reasoning="disabled", max_whitespace_cnt=MAX_BLANKS)
    form = tag.format if named else TagsWithSeparatorFormat(tags=tag.format.tags, separator="\n", at_least_one=True,
                                                            stop_after_first=not job.parallel_tool_calls)
    if choice == "auto":  # a call, or the answer in its format
        form = OrFormat(elements=[form, JSONSchemaFormat(json_schema=json.loads(answer).get("schema", ANY_OBJECT),
                                                         max_whitespace_cnt=MAX_BLANKS)])
    return json.dumps({"type": "structural_tag", "structural_tag": StructuralTag(format=form).model_dump(mode="json")},
                      separators=(",", ":"), ensure_ascii=False)
