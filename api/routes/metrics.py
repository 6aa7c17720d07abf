"""`GET /metrics`: the figures of `api.service.metrics.ApiMetrics`, for a scrape that may read them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.service.metrics import ApiMetrics

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Answered on the event loop from the last figures: a flood of scrapes takes none of the threads that
    `/healthz` and the routes run on."""
    feed: ApiMetrics = request.app.state.metrics
    if not feed.allows(request.headers.get("authorization")):
        raise HTTPException(401, "missing or wrong metrics key (Authorization: Bearer "
                            "<CONVOQ_METRICS_KEY>)", headers={"WWW-Authenticate": "Bearer"})
    return Response(generate_latest(feed.registry), media_type=CONTENT_TYPE_LATEST)
