"""How a job becomes the prompt the model sees, and the one rule for whether it can run on a model.

The API uses it to refuse at the door what could never run, the worker to build the prompts it runs (and to
fail, with the same reason, what slipped past an API that could not read the model). It needs a tokenizer
object with the model's chat template, never the model. Both count and encode a prompt one way: only the
template's own scaffolding yields control tokens, a customer's strings stay text (`jobs.customer_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobs.customer_text import Names, hide, holds_names, names, spelled
from jobs.customer_text import encode as encode_hidden
from jobs.schemas import JobIn, Message
from jobs.tool_calls import template_tools

# messages as a chat template takes them: role and content, and OpenAI's tool_calls and tool_call_id
Chat = list[dict[str, Any]]

SUMMARY_INSTRUCTION = (
    "You summarize customer-service conversations for the support team. Write a short summary: the customer's "
    "problem, what the agent did, and whether it was resolved. Do not invent details."
)
COMBINE_INSTRUCTION = (
    "You are given summaries of consecutive parts of one customer-service conversation, in order. Combine them "
    "into one short summary: the customer's problem, what the agent did, and whether it was resolved."
)


@dataclass(frozen=True)
class Prompt:
    """A chat rendered by the model's template. Where a customer's string held the name of a control token,
    `names` is set and `rendered` holds stand-ins for those names (`jobs.customer_text`)."""

    rendered: str
    names: Names | None = None

    @property
    def text(self) -> str:
        """What the model reads, the customer's strings as written."""
        return self.rendered if self.names is None else spelled(self.names, self.rendered)


def render(tokenizer, chat: Sequence[Mapping[str, Any]], thinking: bool, tools: list[dict] | None = None) -> Prompt:
    """A chat rendered by the model's chat template, ending with the assistant's turn opener. `thinking` goes
    to the template as `enable_thinking`: off, Qwen3's template opens the answer with an empty think block; a
    template without the switch ignores it. `tools` (OpenAI's function tools) are the template's to show: Qwen3's
    lists them in the system prompt. A name of a control token in a customer's string is hidden from the
    template, to stay text."""
    found = names(tokenizer)
    if not holds_names(found, chat, tools):
        return Prompt(_template(tokenizer, chat, thinking, tools))
    messages, shown = hide(found, chat, tools)
    return Prompt(_template(tokenizer, messages, thinking, shown), found)


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a rendered chat: only the template's own scaffolding yields control tokens, a customer's
    strings are text. The rule for the API's length check and the worker's prompts alike."""
    if prompt.names is None:  # nothing to keep apart: the whole string, as the template's own tokenization
        return encode_rendered(tokenizer, prompt.rendered)
    return encode_hidden(tokenizer, prompt.names, prompt.rendered, rendered_encoder(tokenizer))


def encode_chat(tokenizer, chat: Sequence[Mapping[str, Any]], thinking: bool,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat (`render`, then `prompt_ids`)."""
    return prompt_ids(tokenizer, render(tokenizer, chat, thinking, tools))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat, its control tokens (`<|im_start|>`...) read as such, as the template's own
    tokenization does (`apply_chat_template(tokenize=True)`)."""
    return rendered_encoder(tokenizer)(text)


def rendered_encoder(tokenizer) -> Callable[[str], list[int]]:
    """What `encode_rendered` calls, chosen once for the pieces of one prompt.

    A fast tokenizer's Rust tokenizer is called directly, without transformers' call around it: that call
    encodes through `encode_batch`, which lets go of the interpreter lock for a few microseconds of work, and
    getting it back behind a busy thread of the same process takes up to a switch interval (5 ms). In a worker
    whose other threads are busy, that made a prompt cost 0.24 ms of CPU and 5 ms of wall time instead of
    0.06 and 0.1 (`python -m bench.prompt_encode`). Transformers' call also resets the Rust tokenizer's
    truncation, padding and special-token splitting; where any of those is set, it is left to do so.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens or getattr(tokenizer, "split_special_tokens", False)):
        return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return lambda text: backend.encode(text, add_special_tokens=False).ids


def _template(tokenizer, chat: Sequence[Mapping[str, Any]], thinking: bool, tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template([dict(m) for m in chat], tools=tools, add_generation_prompt=True,
                                         tokenize=False, enable_thinking=thinking)


def token_per_byte_at_most(tokenizer) -> bool:
    """Whether no text tokenizes to more tokens than its UTF-8 bytes: true of a byte-level BPE that normalizes
    nothing (Qwen's), whose every token spells one byte or more (a special token, its whole name)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and backend.normalizer is None and isinstance(backend.decoder, decoders.ByteLevel)


def thinking_of(job: JobIn, default_thinking: bool) -> bool:
    """Whether `job` lets the model reason first: as it says, else summaries never and chats by the default."""
    if job.thinking is not None:
        return job.thinking
    return default_thinking and job.kind == "chat"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a thinking model's output `<think>reasoning</think>answer`; (None, text) when
    it holds no think block. A block never closed (the output budget ran out) is all reasoning."""
    head, opened, rest = text.partition("<think>")
    if not opened or head.strip():
        return None, text
    reasoning, closed, answer = rest.partition("</think>")
    return reasoning.strip(), answer.strip() if closed else ""


def render_transcript(turns: Sequence[Message]) -> str:
    return "\n".join(f"{m.role}: {m.content}" for m in turns)


def chat_for(job: JobIn) -> Chat:
    """`chat` jobs go to the model as they are; `summarize` jobs wrap the transcript in an instruction."""
    if job.kind == "summarize":
        return [
            {"role": "system", "content": SUMMARY_INSTRUCTION},
            {"role": "user", "content": "Conversation:\n" + render_transcript(job.messages)},
        ]
    return [m.model_dump(exclude_none=True) for m in job.messages]


def part_chat(turns: Sequence[Message], part: int, parts: int) -> Chat:
    """One chunk of a transcript too long for the model's context."""
    return [
        {"role": "system", "content": SUMMARY_INSTRUCTION},
        {"role": "user", "content": f"Part {part} of {parts} of a longer conversation:\n" + render_transcript(turns)},
    ]


def combine_chat(summaries: Sequence[str]) -> Chat:
    body = "\n".join(f"Part {i}: {s}" for i, s in enumerate(summaries, 1))
    return [{"role": "system", "content": COMBINE_INSTRUCTION}, {"role": "user", "content": body}]


def prompt_budget(context: int, max_new_tokens: int) -> int:
    """The most prompt tokens that leave room for `max_new_tokens` of output in the model's context."""
    return context - max_new_tokens


def chat_problem(prompt_tokens: int, max_new_tokens: int, context: int) -> str | None:
    """Why a prompt of `prompt_tokens` can never run with this output budget, or None: both must fit."""
    if prompt_tokens > prompt_budget(context, max_new_tokens):
        return (f"the prompt has {prompt_tokens} tokens; with max_new_tokens {max_new_tokens} it exceeds the "
                f"model's context of {context} tokens")
    return None


def summary_problem(max_new_tokens: int, context: int) -> str | None:
    """Why no transcript can be summarized with this output budget, or None. A transcript of any length is
    map-reduced, which needs at least two partial summaries and the output in one prompt."""
    if 3 * max_new_tokens > context:
        return (f"max_new_tokens {max_new_tokens} is too large to summarize with this model's context of "
                f"{context} tokens (at most {context // 3})")
    return None


def problem(job: JobIn, tokenizer, context: int, default_thinking: bool) -> tuple[str, str] | None:
    """(field, message) when `job` can never run on a model with this tokenizer and context, else None."""
    max_new = job.sampling.max_new_tokens
    if job.kind == "summarize":
        message = summary_problem(max_new, context)
        return None if message is None else ("max_new_tokens", message)
    try:
        prompt = render(tokenizer, chat_for(job), thinking_of(job, default_thinking), template_tools(job))
        # most prompts fit by their bytes alone: tokenizing them (most of an ingested line's cost) settles nothing
        if len(prompt.text.encode()) <= prompt_budget(context, max_new) and token_per_byte_at_most(tokenizer):
            return None
        prompt_tokens = len(prompt_ids(tokenizer, prompt))  # as the worker tokenizes it
    except Exception as exc:  # a template may refuse a chat (Qwen's raise when a system message is not first)
        return "messages", f"the model's chat template cannot render these messages: {exc}"
    message = chat_problem(prompt_tokens, max_new, context)
    return None if message is None else ("messages", message)
