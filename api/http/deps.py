"""Request-scoped dependencies: settings, database sessions, the publisher, the intake of new work, the caller and
what it may see; and what routes document in common.

`api.http.gate.Gate` authenticates every `/v1/` request before its body is read; routes take the result as
`Caller` (an `ApiKey`: its hash, scopes and tenant). Jobs, batches and files belong to a tenant: another
tenant is told they do not exist (404, never 403), `admin` keys see every tenant's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from celery import Celery
from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from sqlalchemy import Delete, Select
from sqlalchemy.orm import Session, sessionmaker

from api.http.admission import Admission
from api.schemas.errors import ErrorOut
from api.service.health import Probe
from api.service.prompt_check import PromptCheck
from api.streams.hub import Hub
from broker.affinity import Router
from jobs.settings import ApiKey, Settings

Statement = TypeVar("Statement", Select, Delete)
bearer = HTTPBearer(auto_error=False, description="An API key from CONVOQ_API_KEYS")

# The dependencies that only read the app's state are `async def`: FastAPI runs a plain `def` dependency on its
# thread pool, a hop to a thread and back for each of them on every request (in a burst of submissions, ~15% of
# the API's CPU went to those hops).


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def get_session(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)]) -> Iterator[Session]:
    with sessions() as session:
        yield session


async def get_celery(request: Request) -> Celery:
    return request.app.state.celery


async def get_hub(request: Request) -> Hub:
    return request.app.state.hub


async def get_probe(request: Request) -> Probe:
    return request.app.state.probe


@dataclass(frozen=True)
class Intake:
    """What new work passes on its way in, one of each per API process: where it is stored and published, the
    prompt check (what can never run is refused), admission (the bounds on unfinished jobs), what starts a stored
    batch's ingest under its lease (`batch_ingest.Ingests.submit`), and the conversations' router. One
    dependency for all of it: FastAPI resolves each of a route's dependencies on every request, a cost a
    submission feels."""

    settings: Settings
    sessions: sessionmaker[Session]
    celery: Celery
    check: PromptCheck
    admission: Admission
    ingest: Callable[[uuid.UUID, uuid.UUID], object]
    router: Router  # where a job with a conversation is published (`broker.affinity`)


async def get_intake(request: Request) -> Intake:
    return request.app.state.intake


async def get_caller(request: Request, _: Annotated[object, Depends(bearer)]) -> ApiKey:
    """The key the gate admitted (`bearer` only documents the scheme in the OpenAPI document)."""
    return request.state.caller


def sees(caller: ApiKey, tenant: str | None) -> bool:
    """Whether `caller` may see a row of `tenant`."""
    return "admin" in caller.scopes or tenant == caller.tenant


def visible(rows: Statement, table: Any, caller: ApiKey) -> Statement:
    """`rows` of `table` (which has `tenant`) narrowed to what `caller` may see."""
    return rows if "admin" in caller.scopes else rows.where(table.tenant == caller.tenant)


def errors(**described: str) -> dict[int | str, dict]:
    """OpenAPI responses for error statuses, keyed `e404="..."`: every one has the one error body."""
    return {int(code.removeprefix("e")): {"model": ErrorOut, "description": text} for code, text in described.items()}


# What the gate and FastAPI's validation can answer on every /v1 route (routers add these to each route).
V1_ERRORS = errors(
    e400="The body could not be parsed (not UTF-8, or not the content type it declares)",
    e401="Missing or unknown API key (past CONVOQ_AUTH_FAILURES_BURST unknown keys from one address, that "
         "address's unknown keys get 429 instead)",
    e403="The API key lacks the scope this method needs (GET reads, other methods submit)",
    e413="The request body is larger than CONVOQ_MAX_REQUEST_BYTES (uploads: CONVOQ_MAX_UPLOAD_BYTES)",
    e422="A parameter or the body does not validate (`detail` lists each problem with its `loc`)",
    e429="The API key's request rate, or this address's failed authentications, are exceeded (see Retry-After)",
)

# a batch's output and error lines, as both the batch and the file routes stream them
JSONL_TYPE = "application/jsonl"
JSONL = {200: {"description": "JSON Lines, one OpenAI Batch output line each", "content": {JSONL_TYPE: {}}}}

SettingsDep = Annotated[Settings, Depends(get_settings)]
# closed when the route returns, before its response is sent: a streamed body never holds a connection
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
CeleryDep = Annotated[Celery, Depends(get_celery)]
HubDep = Annotated[Hub, Depends(get_hub)]
ProbeDep = Annotated[Probe, Depends(get_probe)]
IntakeDep = Annotated[Intake, Depends(get_intake)]
Caller = Annotated[ApiKey, Depends(get_caller)]
