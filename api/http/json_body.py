"""JSON request bodies parsed within `jobs.bounded_json.MAX_JSON_DEPTH`, and the JSON schemas they hold vetted:
routers whose routes take a JSON body use `BoundedJsonRoute`.

- A body nested deeper is a 422 naming the problem, before any model sees it (Python's parser would give up at
  its recursion limit, and what it let through could fail a response later).
- A number no float holds (NaN, Infinity, 1e400) is a 400: Python would read it as a float that JSON cannot
  write back, and the stored job would hold null in its place.
- A JSON schema (`response_format`'s, a tool's `parameters`) past the settings' bounds is a 400 naming the
  bound; the others are checked against their meta-schema here, their verdicts left for the job's validation
  (`jobs.structured.vet`).
A body larger than `INLINE_BYTES` is parsed and vetted on a thread: a schema near its bounds takes tens of
milliseconds to check, and the event loop serves every stream and probe of the process meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute

from jobs.bounded_json import UnheldNumber, bounded_json
from jobs.structured import VERDICTS, SchemaBounds, SchemaTooLarge, vet

INLINE_BYTES = 16 * 1024  # smaller bodies are read on the event loop: a hop to a thread would cost more


def read_body(body: bytes, bounds: SchemaBounds) -> tuple[Any, dict[int, tuple[object, str | None]]]:
    """The parsed body and the verdicts of its schemas; raises what `bounded_json` and `vet` raise."""
    value = bounded_json(body)
    return value, vet(value, bounds)


class BoundedJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            read = partial(read_body, body, SchemaBounds.of(self.app.state.settings))
            try:
                value, verdicts = read() if len(body) <= INLINE_BYTES else await run_in_threadpool(read)
            except json.JSONDecodeError:  # FastAPI's own 422 `json_invalid`
                raise
            except (UnheldNumber, SchemaTooLarge) as exc:
                raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
            except ValueError as exc:  # the same 422, saying what is wrong (FastAPI lets an HTTPException through)
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                    [{"loc": ["body"], "msg": str(exc), "type": "json_invalid"}]) from None
            VERDICTS.set(verdicts)  # this request's task validates the body next, and reads them
            self._json = value
        return self._json


class BoundedJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(BoundedJsonRequest(request.scope, request.receive))

        return bounded
