"""A job's result as the API shows it: its choices, with their tool calls and logprobs."""

from __future__ import annotations

from pydantic import BaseModel, Field

from jobs.schemas import ToolCall


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="-9999.0 stands for minus infinity (a token the grammar rules out), as in OpenAI's")
    bytes: list[int] = Field(description="the token's bytes (a character's may span tokens)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely tokens at this position, best first")


class ChoiceOut(BaseModel):
    """One answer: a job's result is its first (choice 0); a job with `n` > 1 lists the others in `choices`."""

    text: str = Field(description="the answer (with thinking, what follows the reasoning), without its tool calls")
    reasoning: str | None = Field(None, description="with thinking: the reasoning, without its <think> tags")
    completion_tokens: int = Field(description="every generated token, the reasoning's included; a result's: "
                                               "those of all its choices")
    finish_reason: str = Field(description="stop | length | tool_calls | cancelled | expired (the last two keep the "
                                           "text so far)")
    tool_calls: list[ToolCall] | None = Field(None, description="the tools the answer called (OpenAI's "
                                              "`message.tool_calls`), parsed out of its text")
    logprobs: list[TokenLogprob] | None = Field(None, description="when the job asked for logprobs: OpenAI's "
                                                "`logprobs.content`, one entry per token of the answer (with "
                                                "thinking, the tokens after the reasoning)")


class ResultOut(ChoiceOut):
    prompt_tokens: int = Field(description="counted once, however many choices share the prompt")
    choices: list[ChoiceOut] | None = Field(None, description="a job with n > 1: choices 1..n-1 (the result "
                                                              "itself is choice 0)")
