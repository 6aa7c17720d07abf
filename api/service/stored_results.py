"""Results read with each answer's log-probabilities left as the JSON text stored (`api.http.raw_json`), never parsed:
the answers themselves (text, reasoning, tool calls) are a few kilobytes each, their log-probabilities can be
tens of megabytes.

An answer beyond the first is an entry of the result's `choices` column; PostgreSQL takes the entries apart
(`json_array_elements`, whose `->` gives a member's text as it was stored), so that the column is never parsed
here either. With `lengths_only` only the log-probabilities' lengths are read: what sizing a file of them needs.
SQLite (the demo's database, small deployments) has neither, so there the `choices` column is parsed and each
entry's log-probabilities written back as JSON text; SQLAlchemy stores JSON ASCII-escaped, so a length in
characters is one in bytes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Integer, LargeBinary, Text, bindparam, cast, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import Uuid

from jobs.tables import Result


class byte_length(FunctionElement):
    """A value's length in bytes, measured by the database: PostgreSQL's `octet_length`, which SQLite gained only
    in 3.43; a BLOB's `length` is its bytes there."""

    type = Integer()
    inherit_cache = True


@compiles(byte_length)
def _octet_length(element: byte_length, compiler, **kw) -> str:
    return f"octet_length({compiler.process(element.clauses, **kw)})"


@compiles(byte_length, "sqlite")
def _blob_length(element: byte_length, compiler, **kw) -> str:
    return compiler.process(func.length(cast(next(iter(element.clauses)), LargeBinary)), **kw)


# a JSON null (what an absent list is stored as) is no value
_CHOICES = """
SELECT r.job_id, e.value->>'text', e.value->>'reasoning', (e.value->>'completion_tokens')::int,
       e.value->>'finish_reason', NULLIF((e.value->'tool_calls')::text, 'null'), {logprobs}
FROM results r CROSS JOIN LATERAL json_array_elements(
    CASE WHEN json_typeof(r.choices) = 'array' THEN r.choices END) WITH ORDINALITY AS e(value, ord)
WHERE r.job_id = ANY(:ids)
ORDER BY r.job_id, e.ord
"""
_LOGPROBS = "NULLIF((e.value->'logprobs')::text, 'null')"


@dataclass
class StoredResult:
    """A result as its row holds it (what `api.service.batch_output.completion` reads), but each answer's
    `logprobs` None and held apart, in `held`, by answer: the stored text (or its length), None if it has none."""

    text: str
    reasoning: str | None
    completion_tokens: int
    finish_reason: str
    tool_calls: list | None
    prompt_tokens: int
    chunks: int
    levels: int
    created_at: datetime
    choices: list[dict] = field(default_factory=list)
    held: list[str | int | None] = field(default_factory=list)
    logprobs: None = None


def _tool_calls(stored: str | None) -> list | None:
    return None if stored is None else json.loads(stored)


def read_results(session: Session, job_ids: Sequence[uuid.UUID],
                 lengths_only: bool = False) -> dict[uuid.UUID, StoredResult]:
    """The stored results of these jobs (those that have one), by job id."""
    if not job_ids:
        return {}
    postgres = session.get_bind().dialect.name == "postgresql"
    stored = func.nullif(cast(Result.logprobs, Text), "null")
    rows = session.execute(select(Result.job_id, Result.text, Result.reasoning, Result.completion_tokens,
                                  Result.finish_reason, func.nullif(cast(Result.tool_calls, Text), "null"),
                                  Result.prompt_tokens, Result.chunks, Result.levels, Result.created_at,
                                  byte_length(stored) if lengths_only else stored)
                           .where(Result.job_id.in_(job_ids)))
    found = {}
    for job_id, text_, reasoning, tokens, finish, calls, prompt, chunks, levels, created, logprobs in rows:
        found[job_id] = StoredResult(text_, reasoning, tokens, finish, _tool_calls(calls), prompt, chunks, levels,
                                     created, held=[logprobs])
    if not postgres:
        _parsed_choices(session, found, lengths_only)
        return found
    others = _CHOICES.format(logprobs=f"octet_length({_LOGPROBS})" if lengths_only else _LOGPROBS)
    for job_id, text_, reasoning, tokens, finish, calls, logprobs in session.execute(
            text(others).bindparams(bindparam("ids", type_=ARRAY(Uuid))), {"ids": list(found)}):
        found[job_id].choices.append({"text": text_, "reasoning": reasoning, "completion_tokens": tokens,
                                      "finish_reason": finish, "tool_calls": _tool_calls(calls)})
        found[job_id].held.append(logprobs)
    return found


def _parsed_choices(session: Session, found: dict[uuid.UUID, StoredResult], lengths_only: bool) -> None:
    """`read_results`' choices where the database cannot take JSON apart: each entry parsed, its log-probabilities
    held as their JSON text (or its length)."""
    for job_id, choices in session.execute(select(Result.job_id, Result.choices).where(Result.job_id.in_(found))):
        for entry in choices or []:
            logprobs = entry.get("logprobs")
            held = None if logprobs is None else json.dumps(logprobs)
            found[job_id].choices.append({"text": entry.get("text"), "reasoning": entry.get("reasoning"),
                                          "completion_tokens": entry.get("completion_tokens"),
                                          "finish_reason": entry.get("finish_reason"),
                                          "tool_calls": entry.get("tool_calls")})
            found[job_id].held.append(len(held) if lengths_only and held is not None else held)
