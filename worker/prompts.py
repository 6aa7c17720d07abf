"""How a job's messages become the chat the model sees."""

from __future__ import annotations

SUMMARY_INSTRUCTION = (
    "You summarize customer-service conversations for the support team. Write a short summary: the customer's "
    "problem, what the agent did, and whether it was resolved. Do not invent details."
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
