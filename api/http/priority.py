"""Which priority a request runs at: the `X-Convoq-Priority` header, then the body's, then the route's default.

The header comes first: it sets the priority without touching the body (which the `openai` SDK writes).
Each route's default is stated once: `POST /v1/jobs` `jobs.priority.DEFAULT_PRIORITY` (its body's default; it
has no header), `POST /v1/batches` `jobs.priority.DEFAULT_BATCH_PRIORITY` (bulk work: low, so that chats
overtake it), `POST /v1/chat/completions` CONVOQ_INTERACTIVE_PRIORITY (a person waits on it).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header

from jobs.priority import RANGE, Priority


def _header(precedence: str) -> object:
    """The `X-Convoq-Priority` header (its parameter must be named `x_convoq_priority`). Typed `int` so that the
    document says integer (a header is never JSON null); absent, it is None."""
    return Annotated[Priority, Header(description=f"{RANGE}; {precedence}")]


BatchPriorityHeader = _header("before the body's `priority` (multipart) or `metadata.priority` (JSON); bulk work "
                              "defaults low")
ChatPriorityHeader = _header("before `metadata.priority`; interactive by default")


def chosen_priority(header: int | None, body: int | None, default: int) -> int:
    return next(p for p in (header, body, default) if p is not None)
