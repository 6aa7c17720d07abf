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


def require_key(
    settings: Annotated[Settings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """The hash of the caller's key; 401 unless it is one of the configured keys."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing API key (Authorization: Bearer <key>)",
                            headers={"WWW-Authenticate": "Bearer"})
    offered = hash_key(credentials.credentials)
    # compare against every key, always, so timing says nothing about which prefix matched
    matched = False
    for known in settings.api_key_hashes:
        matched |= hmac.compare_digest(offered, known)
    if not matched:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
    return offered


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
CeleryDep = Annotated[Celery, Depends(get_celery)]
KeyDep = Annotated[str, Depends(require_key)]
