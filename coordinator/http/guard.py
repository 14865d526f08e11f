"""ASGI guard in front of the API: the token is checked, and the body size, before any body is read.

FastAPI reads and parses a request body before its dependencies run, so a token dependency
alone lets anyone make the coordinator buffer and parse a large body. This middleware answers
``/v1/*`` requests that carry no valid bearer token with 401, and bodies whose declared
``Content-Length`` is over the route's cap with 413, without receiving a byte of the body;
bodies without a length (chunked) get 411. The token is accepted only in the
``Authorization`` header: the console's address carries ``?token=`` for its first load only
(the page reads it in the browser and sends it as a bearer token; the page needs no token).
The API's own description (``/docs``, ``/redoc``, ``/openapi.json``) needs the token too,
unless the operator opens it (``open_docs``; ``fedshard coordinator --open-docs``): it lists
every route an attacker could try.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.http.errors import error_json

MAX_JSON_BODY_BYTES = 32 << 20
"""Largest JSON request body (256 embeddings inputs of 100,000 characters fit)."""
MAX_NPZ_BODY_BYTES = 256 << 20
"""Largest ``/v1/infer`` body (an ``.npz`` of tensors)."""
_LARGE_ROUTES = frozenset({"/v1/infer"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def body_limit(path: str) -> int:
    """The body cap of a route."""
    return MAX_NPZ_BODY_BYTES if path in _LARGE_ROUTES else MAX_JSON_BODY_BYTES


class ApiGuard:
    """Refuses unauthenticated and oversized ``/v1`` requests before their bodies are read."""

    def __init__(self, app: ASGIApp, token: str, open_docs: bool = False) -> None:
        """``open_docs``: serve :data:`DOC_PATHS` without the token."""
        self._app = app
        self._token = token.encode()
        self._open_docs = open_docs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http" or not self._guarded(str(scope["path"])):
            await self._app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self._token):
            await _reply(send, scope, 401, "a valid bearer token is required", bearer=True)
            return
        if scope["method"] in _BODY_METHODS:
            refusal = _body_refusal(headers, body_limit(str(scope["path"])))
            if refusal is not None:
                await _reply(send, scope, *refusal)
                return
        await self._app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (path in DOC_PATHS and not self._open_docs)


def _body_refusal(headers: dict[bytes, bytes], limit: int) -> tuple[int, str] | None:
    length = headers.get(b"content-length")
    if length is None:
        if headers.get(b"transfer-encoding"):
            return 411, "send the body with a Content-Length"
        return None
    if not length.isdigit():
        return 400, "bad Content-Length"
    if int(length) > limit:
        return 413, f"a body of {int(length)} bytes is over this route's {limit}-byte limit"
    return None


async def _reply(send: Send, scope: Scope, status: int, detail: str, bearer: bool = False) -> None:
    body = json.dumps(error_json(str(scope["path"]), status, detail)).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
