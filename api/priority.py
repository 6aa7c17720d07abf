"""Which priority a request runs at: the `X-Convoq-Priority` header, then the body's, then the route's default.

The header comes first: it sets the priority without touching the body (which the `openai` SDK writes).
Each route's default is stated once: `POST /v1/jobs` `jobs.schemas.DEFAULT_PRIORITY` (its body's default; it
has no header), `POST /v1/batches` `jobs.schemas.DEFAULT_BATCH_PRIORITY` (bulk work: low, so that chats
overtake it), `POST /v1/chat/completions` CONVOQ_INTERACTIVE_PRIORITY (a person waits on it).
"""

from __future__ import annotations


def chosen_priority(header: int | None, body: int | None, default: int) -> int:
    return next(p for p in (header, body, default) if p is not None)
