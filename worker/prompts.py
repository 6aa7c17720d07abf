"""How a job's messages become the chat the model sees."""

from __future__ import annotations

SUMMARY_INSTRUCTION = (
    "You summarize customer-service conversations for the support team. Write a short summary: the customer's "
    "problem, what the agent did, and whether it was resolved. Do not invent details."
)
COMBINE_INSTRUCTION = (
    "You are given summaries of consecutive parts of one customer-service conversation, in order. Combine them "
    "into one short summary: the customer's problem, what the agent did, and whether it was resolved."
)


def render_transcript(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def chat_for(kind: str, messages: list[dict]) -> list[dict]:
    """`chat` jobs go to the model as they are; `summarize` jobs wrap the transcript in an instruction."""
    if kind == "summarize":
        return [
            {"role": "system", "content": SUMMARY_INSTRUCTION},
            {"role": "user", "content": "Conversation:\n" + render_transcript(messages)},
        ]
    return messages


def part_chat(messages: list[dict], part: int, parts: int) -> list[dict]:
    """One chunk of a transcript too long for the model's context."""
    return [
        {"role": "system", "content": SUMMARY_INSTRUCTION},
        {"role": "user", "content": f"Part {part} of {parts} of a longer conversation:\n" + render_transcript(messages)},
    ]


def combine_chat(summaries: list[str]) -> list[dict]:
    body = "\n".join(f"Part {i}: {s}" for i, s in enumerate(summaries, 1))
    return [{"role": "system", "content": COMBINE_INSTRUCTION}, {"role": "user", "content": body}]
