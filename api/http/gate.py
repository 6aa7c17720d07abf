"""The gate every request passes before any of its body is read: API key, scope, rate limits, size.

A pure ASGI middleware, so nothing (not FastAPI's body parsing, not a multipart parser) has called
`receive()` when it decides: a caller with a wrong key gets its 401 however large the body it announced, and
a body whose `Content-Length` is over the limit gets 413 unread. A body sent without a length is counted as
it is read and stopped (413) at the limit.

Under `/v1/` a request needs a key; the scope follows from the method (GET/HEAD read, everything else
submits; `admin` may do both). What the key grants is left in `scope["state"]["caller"]` for the routes.
The key is checked first: a valid key is never refused for anyone's failures. Unknown keys are counted per
client address: past `auth_failures_burst` (refilled at `auth_failures_per_s`) that address's unknown keys
get 429 instead of 401. The address is the ASGI client: behind a TLS-terminating proxy, the proxy's, unless
`convoq api` is told to believe its forwarded headers (`CONVOQ_FORWARDED_ALLOW_IPS`), so that one client's
failures are not everyone's.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http.errors import error_body
from api.http.ratelimit import RateLimiter
from jobs.settings import ApiKey, Settings, hash_key

PROTECTED = "/v1/"
UPLOAD_PATHS = ("/v1/batches", "/v1/files")
READ_METHODS = ("GET", "HEAD")
MULTIPART_ENVELOPE = 2**20  # room for the multipart boundaries and form fields around an upload


def needed_scope(method: str) -> str:
    return "read" if method in READ_METHODS else "submit"


def authenticate(known: dict[str, ApiKey], offered: str) -> ApiKey | None:
    """The grant of `offered`, compared in constant time against every key, always, so timing says nothing
    about which key (or prefix) matched."""
    digest = hash_key(offered)
    found = None
    for known_digest, grant in known.items():
        if hmac.compare_digest(digest, known_digest):
            found = grant
    return found


class Gate:
    def __init__(self, app: ASGIApp, settings: Settings, per_key: RateLimiter, failures: RateLimiter) -> None:
        self.app = app
        self.known = settings.known_keys
        self.max_bytes = settings.max_request_bytes
        self.max_upload_bytes = settings.max_upload_bytes + MULTIPART_ENVELOPE
        self.per_key = per_key
        self.failures = failures
        self.rate = settings.rate_limit_per_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._admit(scope)
        if refusal is not None:
            await _refuse(send, scope["path"], *refusal)
            return
        limit = self.max_upload_bytes if scope["path"] in UPLOAD_PATHS else self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, scope["path"], 413, f"request body larger than {limit} bytes")
            return
        await self.app(scope, _counted(receive, limit), send)

    def _admit(self, scope: Scope) -> tuple[int, str, dict[str, str]] | None:
        """None if the request may go on (the caller's grant recorded), else (status, detail, headers)."""
        if not scope["path"].startswith(PROTECTED):
            return None
        client = scope.get("client")
        address = client[0] if client else "unknown"
        scheme, _, offered = (_header(scope, b"authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not offered.strip():
            return 401, "missing API key (Authorization: Bearer <key>)", {"WWW-Authenticate": "Bearer"}
        grant = authenticate(self.known, offered.strip())
        if grant is None:
            blocked = self.failures.take(address)
            if blocked > 0:
                return 429, "too many failed authentications from this address; retry later", _retry(blocked)
            return 401, "invalid API key", {"WWW-Authenticate": "Bearer"}
        scope_name = needed_scope(scope["method"])
        if scope_name not in grant.scopes and "admin" not in grant.scopes:
            return 403, f"this API key lacks the {scope_name!r} scope", {}
        wait = self.per_key.take(grant.digest)
        if wait > 0:
            return 429, f"rate limit of {self.rate:g} requests/s exceeded; retry later", _retry(wait)
        scope["state"] = {**scope.get("state", {}), "caller": grant}
        return None


def _retry(wait: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, round(wait)))}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _counted(receive: Receive, limit: int) -> Receive:
    """`receive` that stops a body (413) once more than `limit` bytes of it came."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                # an HTTPException passes FastAPI's body parsing as it is, and becomes our JSON 413
                raise HTTPException(413, f"request body larger than {limit} bytes")
        return message

    return counted


async def _refuse(send: Send, path: str, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(error_body(path, status, detail)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
