"""JSON request bodies parsed within `jobs.schemas.MAX_JSON_DEPTH`: routers whose routes take a JSON body use
`BoundedJsonRoute`, so a body nested deeper is a 422 naming the problem, before any model sees it (Python's
parser would give up at its recursion limit, and what it let through could fail a response later)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

from jobs.schemas import bounded_json


class BoundedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = bounded_json(body)
            except json.JSONDecodeError:  # FastAPI's own 422 `json_invalid`
                raise
            except ValueError as exc:  # the same 422, saying what is wrong (FastAPI lets an HTTPException through)
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                    [{"loc": ["body"], "msg": str(exc), "type": "json_invalid"}]) from None
        return self._json


class BoundedJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(BoundedJsonRequest(request.scope, request.receive))

        return bounded
