"""The job as it is submitted (pydantic v2), the contract the API, the client and the worker share: its messages,
sampling, tools, structured output and their bounds.

A job's priority is `jobs.priority.Priority`, the highest the most urgent; the worker maps it to the broker's own
order (`broker.redis_layout`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

from jobs.priority import DEFAULT_PRIORITY, HIGHEST, LOWEST, Priority
from jobs.structured import vetted_problem

MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000
# PostgreSQL text and jsonb cannot hold NUL: a string that is stored documents (and checks) that it has none
NO_NUL = r"^[^\x00]*$"


def error_message(error: dict) -> str:
    """A validation error's message for people: pydantic's, but for NUL, which it would show as a pattern."""
    if error.get("type") == "string_pattern_mismatch" and (error.get("ctx") or {}).get("pattern") == NO_NUL:
        return "must not contain NUL (\\u0000) characters"
    return error.get("msg", "invalid")


MAX_NEW_TOKENS = 4096
MAX_CHOICES = 8  # a job's `n`: OpenAI's allows more, but each choice holds KV blocks of its own
DEFAULT_MAX_NEW_TOKENS = 256


MAX_DEADLINE_S = 7 * 24 * 3600


class Strict(BaseModel):
    # strict: a value of another JSON type is refused, not coerced (`false` is no seed, `0` no boolean), as the
    # OpenAPI document's types say
    model_config = ConfigDict(extra="forbid", strict=True)


MAX_TOOLS = 128  # OpenAI's bound on a request's tools
# OpenAI's pattern for a function's name
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolCallId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NO_NUL)]
Content = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CONTENT_CHARS, pattern=NO_NUL)]


class FunctionCall(Strict):
    name: ToolName
    arguments: str = Field(max_length=MAX_CONTENT_CHARS, pattern=NO_NUL, description="the arguments as JSON text")


class ToolCall(Strict):
    """A call an assistant message made (OpenAI's `message.tool_calls[]`), sent back with the conversation."""

    id: ToolCallId
    type: Literal["function"]
    function: FunctionCall


def _role_rules(schema: dict[str, Any]) -> None:
    """`Message._fields_of_role` in the OpenAPI document, so that a client (or a fuzzer) knows it: a system or
    user message has content, an assistant one content or tool calls, a tool one content and tool_call_id."""
    text = {"type": "string"}
    schema["oneOf"] = [
        {"properties": {"role": {"enum": ["system", "user"]}, "content": text, "tool_calls": {"type": "null"},
                        "tool_call_id": {"type": "null"}}, "required": ["role", "content"]},
        {"properties": {"role": {"const": "assistant"}, "tool_call_id": {"type": "null"}},
         "anyOf": [{"properties": {"content": text}, "required": ["content"]},
                   {"properties": {"tool_calls": {"type": "array", "minItems": 1}}, "required": ["tool_calls"]}]},
        {"properties": {"role": {"const": "tool"}, "content": text, "tool_call_id": text,
                        "tool_calls": {"type": "null"}}, "required": ["role", "content", "tool_call_id"]},
    ]


class Message(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_role_rules)

    role: Literal["system", "user", "assistant", "tool"]
    content: Content | None = Field(None, description="required, but for an assistant message with tool_calls")
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="assistant: the tools it called")
    tool_call_id: ToolCallId | None = Field(None, description="tool (required there): the call this is the answer of")

    @model_validator(mode="before")
    @classmethod
    def _no_content_beside_calls(cls, data: object) -> object:
        # OpenAI's clients send an assistant turn that only called tools with content "" as often as with null
        if isinstance(data, dict) and data.get("tool_calls") and data.get("content") == "":
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _fields_of_role(self) -> Message:
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a message of role {self.role!r} needs content (only an assistant message that calls "
                             "tools may have none)")
        return self


UNSET = ("left unset, the model's generation_config.json decides (CONVOQ_GENERATION_CONFIG=auto), else "
         "convoq's default: ")


class Sampling(Strict):
    """Unset fields (None) take the model's own defaults from its generation_config.json, as `transformers`
    and vLLM do; with CONVOQ_GENERATION_CONFIG=none, or where the model says nothing, convoq's: greedy."""

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS,
                                description="output tokens at most, thinking included")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 means greedy; " + UNSET + "0")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=UNSET + "1")
    top_k: int | None = Field(None, ge=0, le=1000, description="0 means off; " + UNSET + "0")
    min_p: float | None = Field(None, ge=0.0, lt=1.0, description="drop tokens less likely than min_p times the "
                                "most likely one; " + UNSET + "0")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="> 1 makes tokens already in the "
                                             "prompt or output less likely; " + UNSET + "1")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="subtracted from the logit of every "
                                           "token already in the output; convoq's default: 0")
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]] = Field(
        default_factory=list, max_length=8)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    speculative: Literal["off", "ngram"] | None = Field(
        None, description="ngram: the engine may verify draft tokens copied from the prompt and output (and the "
                          "text a grammar forces) several at a time; the output is the same; off: never. Unset: "
                          "CONVOQ_SPECULATIVE")


Key = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w.:@/-]+$")]


MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def _valid_schema(schema: object) -> object:
    # before pydantic's own validation, which copies the dict: the object the API vetted (`jobs.structured.vet`)
    if isinstance(schema, dict) and (problem := vetted_problem(schema)):
        raise ValueError(problem)
    return schema


class JsonSchemaFormat(Strict):
    """OpenAI's `response_format.json_schema`: the answer is JSON that validates against `schema`."""

    # `schema` is the wire name; a field of that name would shadow pydantic's `BaseModel.schema`
    model_config = ConfigDict(extra="forbid", strict=True, serialize_by_alias=True, validate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    schema_: Annotated[dict[str, Any], BeforeValidator(_valid_schema)] = Field(
        alias="schema", description="a JSON schema (checked against its meta-schema; draft 2020-12 unless its "
                                    "`$schema` says otherwise)")
    strict: bool | None = Field(None, description="accepted for OpenAI's clients: the answer always follows the "
                                                  "schema, decoding is constrained by it")


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's `response_format`; `worker.grammar_spec` makes it the engine's grammar
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class FunctionDefinition(Strict):
    name: ToolName
    description: str | None = Field(None, max_length=MAX_CONTENT_CHARS, pattern=NO_NUL)
    parameters: Annotated[dict[str, Any], BeforeValidator(_valid_schema)] | None = Field(
        None, description="the arguments' JSON schema; unset: any JSON object")
    strict: bool | None = Field(None, description="where a tool_choice forces a call, its arguments follow "
                                                  "`parameters`, or with false are any JSON object (OpenAI's)")


class Tool(Strict):
    """OpenAI's function tool: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# what a job gained after its first form (migration 0012: choices, structured outputs, logprobs, tools), each with a
# default of its own: a request that leaves them unset is the job it was before
LATER_OPTIONS = ("n", "response_format", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")


class JobIn(Strict):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    kind: Literal["chat", "summarize"] = "chat"
    priority: Priority = Field(DEFAULT_PRIORITY, description=f"{LOWEST}..{HIGHEST}, {HIGHEST} is the most urgent")
    conversation_id: Key | None = None
    idempotency_key: Key | None = None
    sampling: Sampling = Field(default_factory=Sampling)
    thinking: bool | None = Field(
        None, description="let a thinking model (Qwen3) reason in a <think> block before it answers; the result "
                          "then holds the reasoning apart from the answer. Unset: off for `summarize`, "
                          "CONVOQ_DEFAULT_THINKING for `chat`")
    max_thinking_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="with thinking: once the reasoning is this long the block is "
                                                   "closed and the model answers (within max_new_tokens)")
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_DEADLINE_S,
        description="seconds after creation: not started by then, the job ends `expired` without running; "
                    "still running then, it is stopped and ends `expired` with the text it had",
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="answers to generate for the one prompt (OpenAI's `n`), "
                   "its KV computed once; with a seed, choice i samples with seed + i. Chat jobs only")
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: `json_object` or `json_schema` constrain the answer (after the reasoning, with "
                          "thinking) to JSON, decoded under a grammar so that it always parses and validates; a "
                          "summary's parts run free and its final summary is constrained")
    logprobs: bool = Field(False, description="the result carries each answer token's log-probability "
                                              "(OpenAI's `logprobs.content`)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: the most "
                                     "likely alternatives listed at each token (0..20; unset: none)")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="OpenAI's function tools the model may "
                                     "call (chat jobs): shown to it through its chat template")
    tool_choice: ToolChoice | None = Field(
        None, description="none (no tool is shown), auto (the model decides), required (it calls one or more), or "
                          "a named function (it calls that one); the last two are enforced by a grammar. Unset: "
                          "auto with tools, none without")
    parallel_tool_calls: bool = Field(True, description="false: the answer makes one call at most (a second is "
                                                        "text; enforced by the grammar under `required`)")

    @model_validator(mode="after")
    def _chat_ends_with_a_question(self) -> JobIn:
        if self.kind == "chat" and self.messages[-1].role not in ("user", "tool"):
            raise ValueError("a chat job's last message must have role 'user' or 'tool'")
        return self

    @model_validator(mode="after")
    def _tools_of_chats(self) -> JobIn:
        if self.kind == "summarize":
            if self.tools or self.tool_choice is not None:
                raise ValueError("tools are for chat jobs; a summarize job calls none")
            if any(m.content is None or m.role == "tool" for m in self.messages):
                raise ValueError("a transcript to summarize holds system, user and assistant turns with content")
            return self
        names = [tool.function.name for tool in self.tools or ()]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"tools: each function needs a name of its own; {', '.join(twice)} is given twice")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not among "
                             f"the tools ({', '.join(names) or 'none given'})")
        return self

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> JobIn:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _choices_of_chats(self) -> JobIn:
        # a summary's choices would be choices of its final combine only, the parts' text shared: not OpenAI's n
        if self.kind == "summarize" and self.n > 1:
            raise ValueError("n > 1 is for chat jobs; a summarize job has one summary")
        return self
