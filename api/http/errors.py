"""Error bodies. Every error has `detail` (FastAPI's shape, which our client reads). On the routes the `openai`
SDK calls (files, models, chat completions, batches) it also has OpenAI's `error` object, from which the SDK
raises its typed exceptions (`NotFoundError`, `RateLimitError`, ...) with our message.

Validation errors are 422s that always serialize: each names the field (`loc`) and says what is wrong.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jobs.schemas import error_message

OPENAI_PATHS = ("/v1/files", "/v1/models", "/v1/chat/completions", "/v1/batches")
OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                409: "conflict_error", 429: "rate_limit_error"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"message": message, "type": kind, "param": param, "code": code}


class CodedError(HTTPException):
    """An error whose OpenAI `error.code` says what it is: a job that did not succeed, by its `ErrorCode`."""

    def __init__(self, status_code: int, detail: str, code: str) -> None:
        super().__init__(status_code, detail)
        self.code = code


def error_body(path: str, status: int, detail: object, param: str | None = None, code: str | None = None) -> dict:
    """`{"detail": ...}`, plus OpenAI's `error` object on the routes the `openai` SDK calls."""
    body: dict = {"detail": detail}
    if path.startswith(OPENAI_PATHS):
        message = detail if isinstance(detail, str) else "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
            for d in (detail if isinstance(detail, list) else [detail]))
        body["error"] = openai_error(status, message, param, code)
    return body


def allowed_methods(request: Request) -> str:
    """Every method the API documents at this path (Starlette's own 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(request.scope["path"]):
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods - {"HEAD"}))


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return JSONResponse(error_body(request.url.path, exc.status_code, exc.detail, code=getattr(exc, "code", None)),
                        status_code=exc.status_code, headers=headers or None)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # the offending input is echoed as a short repr: raw values can be NaN/Infinity or bytes, which JSON can't hold
    detail = [
        {"loc": list(e.get("loc", ())), "msg": error_message(e), "type": e.get("type", "value_error"),
         "input": repr(e.get("input"))[:200]}
        for e in exc.errors()
    ]
    first = detail[0]["loc"][-1] if detail and detail[0]["loc"] else None
    return JSONResponse(error_body(request.url.path, 422, detail, param=None if first is None else str(first)), status_code=422)
