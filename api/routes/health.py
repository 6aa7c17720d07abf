"""Liveness (`/healthz`: the database and the broker answer) and readiness (`/readyz`: work is accepted)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from api.deps import CeleryDep, SessionDep, SettingsDep
from jobs.clock import db_now
from jobs.tables import Worker

router = APIRouter(tags=["health"])


def _checks(session: Session, celery) -> dict[str, str]:
    checks = {}
    try:
        session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        with celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    return checks


@router.get("/healthz", responses={503: {"description": "The database or the broker does not answer"}})
def healthz(session: SessionDep, celery: CeleryDep, response: Response) -> dict[str, str]:
    checks = _checks(session, celery)
    if any(v != "ok" for v in checks.values()):
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return checks


@router.get("/readyz", responses={503: {"description": "Not accepting work: a dependency is down or the service "
                                                       "holds as many unfinished jobs as it may"}})
def readyz(request: Request, session: SessionDep, celery: CeleryDep, settings: SettingsDep,
           response: Response) -> dict:
    """Whether new work is accepted now: the database and the broker answer and the unfinished jobs are under
    CONVOQ_MAX_QUEUED. Also says how many workers are alive (heartbeat within CONVOQ_DEAD_AFTER_S)."""
    checks: dict = _checks(session, celery)
    accepting = all(v == "ok" for v in checks.values())
    if checks["database"] == "ok":
        unfinished = request.app.state.admission.unfinished(session)
        checks["unfinished_jobs"] = unfinished
        checks["max_queued"] = settings.max_queued or None
        accepting = accepting and (unfinished is None or unfinished < settings.max_queued)
        alive = db_now(-settings.dead_after_s)  # heartbeats are stamped on the database's clock
        checks["workers_alive"] = session.scalar(
            select(func.count()).select_from(Worker).where(Worker.heartbeat_at >= alive, Worker.stopped_at.is_(None)))
    checks["accepting"] = accepting
    if not accepting:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return checks
