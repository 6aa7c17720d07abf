"""Request-scoped dependencies: settings, database sessions, the publisher, API-key auth."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from celery import Celery
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from jobs.settings import Settings, hash_key

bearer = HTTPBearer(auto_error=False, description="An API key from CONVOQ_API_KEYS")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def get_session(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)]) -> Iterator[Session]:
    with sessions() as session:
        yield session


def get_celery(request: Request) -> Celery:
    return request.app.state.celery


def _authenticate(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> tuple[str, frozenset]:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing API key (Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})
    offered = hash_key(credentials.credentials)
    # compare against every key, always, so timing says nothing about which key or prefix matched
    scopes: frozenset[str] = frozenset()
    for known, known_scopes in settings.api_key_scopes.items():
        if hmac.compare_digest(offered, known):
            scopes = known_scopes
    if not scopes:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return offered, scopes


def require(scope: str):
    """A dependency: the caller's key must carry `scope` and be within its rate limit; yields the key's hash."""

    def check(
        request: Request,
        settings: Annotated[Settings, Depends(get_settings)],
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> str:
        key, scopes = _authenticate(settings, credentials)
        if scope not in scopes and "admin" not in scopes:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"this API key lacks the {scope!r} scope")
        wait = request.app.state.rate_limiter.take(key)
        if wait > 0:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                                f"rate limit of {settings.rate_limit_per_s:g} requests/s exceeded; retry later",
                                headers={"Retry-After": str(max(1, round(wait)))})
        return key

    return check


# what `require` can answer, for the OpenAPI document of every route that uses it
AUTH_ERRORS: dict[int | str, dict] = {
    401: {"description": "Missing or unknown API key"},
    403: {"description": "The API key lacks the scope this route needs"},
    429: {"description": "The API key's request rate is exceeded (see Retry-After)"},
}

SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
CeleryDep = Annotated[Celery, Depends(get_celery)]
SubmitKey = Annotated[str, Depends(require("submit"))]
ReadKey = Annotated[str, Depends(require("read"))]
AdminKey = Annotated[str, Depends(require("admin"))]
