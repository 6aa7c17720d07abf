"""Liveness (`/healthz`: the database and the broker answer) and readiness (`/readyz`: work is accepted)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from api.http.deps import IntakeDep, ProbeDep, SessionDep, SettingsDep
from api.service import health

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "The database or the broker does not answer"}})
def healthz(probe: ProbeDep, response: Response) -> dict[str, str]:
    """Cached for a second or two: it needs no key, so answering it must cost next to nothing."""
    checks = probe.checks()
    if any(v != "ok" for v in checks.values()):
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return checks


@router.get("/readyz", responses={503: {"description": "Not accepting work: a dependency is down or the service "
                                                       "holds as many unfinished jobs as it may"}})
def readyz(session: SessionDep, probe: ProbeDep, settings: SettingsDep, intake: IntakeDep,
           response: Response) -> dict:
    """Whether new work is accepted now: the database and the broker answer and the unfinished jobs are under
    CONVOQ_MAX_QUEUED. Also says how many workers are alive (heartbeat within CONVOQ_DEAD_AFTER_S)."""
    checks: dict = probe.checks()
    accepting = all(v == "ok" for v in checks.values())
    if checks["database"] == "ok":
        unfinished = intake.admission.unfinished(session)
        checks["unfinished_jobs"] = unfinished
        checks["max_queued"] = settings.max_queued or None
        accepting = accepting and (unfinished is None or unfinished < settings.max_queued)
        checks["workers_alive"] = health.workers_alive(session, settings)
    checks["accepting"] = accepting
    if not accepting:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return checks
