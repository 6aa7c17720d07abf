"""Tool calls: which tools a job shows the model, and the model's calls parsed out of its answer.

Qwen3's chat template (and the tiny test model's, `cli.tiny_model`) lists the tools in the system prompt and asks
for each call as a block of its own:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

The worker parses a finished answer's blocks into OpenAI's `tool_calls`; what is left is the answer's text. A
block that is not a call of one of the job's tools (malformed JSON, an unknown name, arguments that are no JSON
object) stays text, as does a block the budget cut off. A stream holds back everything from the first
`<tool_call>` on (`stream_stops`): the text before it streams, the calls come once parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from jobs.bounded_json import bounded_json
from jobs.schemas import JobIn, ToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def offers_tools(tools: Sequence[object] | None, tool_choice: ToolChoice | dict | None) -> bool:
    """Whether the model is shown tools (and its answer parsed for calls): some are given and `tool_choice` is
    not `none`. Takes a job's fields or the same values read from its stored payload."""
    return bool(tools) and tool_choice != "none"


def template_tools(job: JobIn) -> list[dict] | None:
    """The tools as the model's chat template takes them (`tools=`), None when it is shown none."""
    if not offers_tools(job.tools, job.tool_choice):
        return None
    return [tool.model_dump(exclude_none=True) for tool in job.tools]


@dataclass(frozen=True)
class ToolUse:
    """What of an answer can be a call: one of these functions, and only the first unless `parallel`."""

    names: frozenset[str]
    parallel: bool = True


def tool_use(job: JobIn) -> ToolUse | None:
    """The calls the job's answer may make; None when it offers no tool (the answer is all text)."""
    if not offers_tools(job.tools, job.tool_choice):
        return None
    return ToolUse(frozenset(tool.function.name for tool in job.tools), job.parallel_tool_calls)


def stream_stops(stops: Sequence[str], tools: Sequence[object] | None,
                 tool_choice: ToolChoice | dict | None) -> list[str]:
    """What a stream of the job holds back (`api.streams.events.settled`): its stop strings and, when it may call tools,
    everything from the first `<tool_call>` on, which the result gives back parsed."""
    return [*stops, OPEN] if offers_tools(tools, tool_choice) else list(stops)


def _call(block: str, names: frozenset[str]) -> dict | None:
    """OpenAI's tool call for the inside of one `<tool_call>` block, None when it is no call of `names`."""
    try:
        call = bounded_json(block)  # a model may nest deeper than Python's parser can follow
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def parse(text: str, use: ToolUse) -> tuple[str, list[dict] | None]:
    """(text, tool calls) of an answer: the calls it made, in order (None: it made none), and the text around
    them. The text keeps what precedes the first `<tool_call>` as it is, so that it goes on from what a stream
    sent; what lies between and after the calls is kept when it is more than blanks. Without `use.parallel`,
    blocks after the first call are text."""
    calls, pieces, at = [], [], 0
    for block in BLOCK.finditer(text):
        if (call := _call(block[1], use.names)) is None:
            continue
        calls.append(call)
        pieces.append(text[at:block.start()])
        at = block.end()
        if not use.parallel:
            break
    if not calls:
        return text, None
    pieces.append(text[at:])
    return pieces[0] + "".join(piece for piece in pieces[1:] if piece.strip()), calls


def finish_reason(reason: str, calls: list[dict] | None) -> str:
    """OpenAI's `tool_calls` for an answer that ended by itself after calling tools; one cut short keeps its
    reason (`length`, `cancelled`, `expired`)."""
    return "tool_calls" if calls and reason == "stop" else reason
