"""Validation errors as 422s that always serialize: each names the field (`loc`) and says what is wrong."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # the offending input is echoed as a short repr: raw values can be NaN/Infinity or bytes, which JSON can't hold
    detail = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", "invalid"), "type": e.get("type", "value_error"),
         "input": repr(e.get("input"))[:200]}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": detail}, status_code=422)
