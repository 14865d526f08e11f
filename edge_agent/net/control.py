"""The control plane: a small HTTPS/1.1 server (stdlib asyncio + ssl, one request per connection).

Routes (client certificate required, ``coordinator`` role where marked; while unpaired, no
client certificate is asked for and only the pairing routes answer)::

    POST /v1/deploy   coordinator  body from protocols.deploy.encode_deploy_body -> DeployReport
    POST /v1/unload   coordinator  UnloadRequest                               -> AgentStatus
    POST /v1/probe    coordinator  ProbeRequest                                -> ProbeReport
    POST /v1/training/copy  coordinator  TrainingCopyOffer                     -> TrainingCopyStatus
    POST /v1/training/file  coordinator  one file of the offer (raw bytes)     -> TrainingCopyStatus
    GET  /v1/status   coordinator or scraper token                             -> AgentStatus
    GET  /metrics     coordinator or scraper token  Prometheus text format

(``/v1/status`` and ``/metrics`` were open to any paired agent: one agent could read every
other's load and segments.) A route with a ``token`` (``fedshard agent --metrics-token-file``)
is also served to a caller that sends ``Authorization: Bearer TOKEN``, compared in constant
time, whatever certificate it has or lacks; any other caller still needs the route's role.

Before a byte of a body is read, the route, the caller's role and the body's declared size
(deploy: the agent's deploy limit; a training file: the largest file the signed offer still
lacks; every other route: 1 MiB) are checked. A connection that sends
no request head within 30 s, or a body slower than 1 MiB/s after 30 s, is answered 408 and
closed. Bodies of routes open to others than the coordinator (pairing, status) reserve their
declared size from one budget shared by every connection
(:func:`edge_agent.net.budgets.control_body_budget`); a body that does not fit is answered 503
before it is read. Errors come back as :class:`protocols.deploy.ErrorReply` JSON with a 4xx
or 5xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from edge_agent.errors import DeployError, LinkError, PairingError, PeerRejectedError
from edge_agent.net.frame_budget import UnfinishedBudget
from edge_agent.net.tls import Peer, check_peer
from edge_agent.net.wire_errors import control_code_of
from protocols.deploy import ROLE_AGENT, ROLE_COORDINATOR, ErrorReply
from protocols.errors import ControlErrorCode, ProtocolError

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
SMALL_BODY_BYTES = 1 << 20
"""Body cap of every route but deploy (JSON documents of a few KiB)."""
HEAD_TIMEOUT_S = 30.0
"""An established connection that has not sent its request head by then is closed."""
BODY_MIN_RATE = 1 << 20
"""Bytes per second a body must at least arrive at, after a 30 s allowance."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    410: "Gone",
    411: "Length Required",
    413: "Content Too Large",
    422: "Unprocessable Content",
    502: "Bad Gateway",
    503: "Service Unavailable",
    507: "Insufficient Storage",
}


@dataclass(frozen=True)
class Response:
    """An HTTP response."""

    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class Route:
    """A handler and who may call it."""

    handler: Callable[[bytes], Awaitable[Response]]
    roles: frozenset[str] | None
    """Roles allowed to call it; None: anyone who completed the TLS handshake (pairing)."""
    max_body_bytes: int | None = None
    """Largest body this route reads; None: :data:`SMALL_BODY_BYTES` (the deploy route passes
    the agent's deploy limit)."""
    body_limit: Callable[[], int] | None = None
    """When set, the largest body right now (asked before the body is read; a training file
    may be as large as the largest file its signed offer still lacks)."""
    token: bytes | None = field(default=None, repr=False)
    """When set, a caller without one of ``roles`` is served if it sends this bearer token."""


COORDINATOR_ONLY = frozenset({ROLE_COORDINATOR})
ANY_PEER = frozenset({ROLE_COORDINATOR, ROLE_AGENT})


class HttpError(Exception):
    """A request the server refuses before routing it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = _HTTP_CODES.get(status, ControlErrorCode.BAD_REQUEST)


_HTTP_CODES = {
    408: ControlErrorCode.TIMEOUT,
    413: ControlErrorCode.TOO_LARGE,
    503: ControlErrorCode.OVER_BUDGET,
}


class ControlServer:
    """Parses requests, checks the caller's role, dispatches, turns errors into replies."""

    def __init__(
        self,
        routes: dict[tuple[str, str], Route],
        max_body_bytes: int,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_budget: UnfinishedBudget | None = None,
    ) -> None:
        """``body_budget``: shared by the bodies of routes not only for the coordinator."""
        self._routes = routes
        self._max_body = max_body_bytes
        self._head_timeout = head_timeout_s
        self._budget = body_budget

    async def handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Peer
    ) -> None:
        """Serve one request on an established TLS connection, then close it."""
        try:
            response = await self._respond(reader, peer)
        except HttpError as exc:
            response = _error(exc.status, exc.code, str(exc))
        head = (
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}\r\n"
            f"Content-Type: {response.content_type}\r\n"
            f"Content-Length: {len(response.body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.writelines([head, response.body])
        await writer.drain()

    async def _respond(self, reader: asyncio.StreamReader, peer: Peer) -> Response:
        """Route, role and size are checked before a byte of the body is read."""
        method, path, headers = await self._read_head(reader)
        length = self._body_length(headers)
        route = self._routes.get((method, path.split("?", 1)[0]))
        if route is None:
            return _error(404, ControlErrorCode.NOT_FOUND, f"no route {method} {path}")
        try:
            if route.roles is not None and not _bearer_admits(route.token, headers):
                check_peer(peer, roles=route.roles)
        except PeerRejectedError as exc:
            log.warning("refused %s %s from %s: %s", method, path, peer.name, exc)
            hint = " or the operator's metrics token" if route.token is not None else ""
            return _error(403, control_code_of(exc), f"{exc}{hint}")
        limit = min(self._max_body, route.max_body_bytes or SMALL_BODY_BYTES)
        if route.body_limit is not None:
            limit = min(self._max_body, route.body_limit())
        if length > limit:
            raise HttpError(413, f"body of {length} bytes is over this route's {limit}-byte limit")
        budget = None if route.roles == COORDINATOR_ONLY else self._budget
        if budget is not None and not budget.take(length):
            raise HttpError(503, f"busy: {budget.used} bytes of bodies are being read already")
        try:
            return await self._dispatch(route, await _read_body(reader, length), method, path, peer)
        finally:
            if budget is not None:
                budget.give(length)

    async def _dispatch(
        self, route: Route, body: bytes, method: str, path: str, peer: Peer
    ) -> Response:
        try:
            return await route.handler(body)
        except (DeployError, PairingError) as exc:
            log.warning("refused %s %s from %s: %s", method, path, peer.name, exc)
            return _error(exc.http_status, control_code_of(exc), str(exc))
        except ProtocolError as exc:
            log.warning("bad %s %s from %s: %s", method, path, peer.name, exc)
            return _error(400, control_code_of(exc), str(exc))
        except LinkError as exc:
            return _error(502, control_code_of(exc), str(exc))

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout)
        except asyncio.LimitOverrunError as exc:
            raise HttpError(413, "request head too large") from exc
        except asyncio.IncompleteReadError as exc:
            raise HttpError(400, "connection closed inside the request head") from exc
        except TimeoutError as exc:
            raise HttpError(408, f"no request head within {self._head_timeout:g} s") from exc
        if len(head) > MAX_HEAD_BYTES:
            raise HttpError(413, "request head too large")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise HttpError(400, "malformed request line")
        return parts[0], parts[1], _headers(lines[1:])

    def _body_length(self, headers: dict[str, str]) -> int:
        """The declared body length, refused when chunked, malformed or over the limit."""
        if "transfer-encoding" in headers:
            raise HttpError(411, "chunked bodies are not accepted; send Content-Length")
        length_text = headers.get("content-length", "0")
        if not length_text.isdigit():
            raise HttpError(400, "bad Content-Length")
        length = int(length_text)
        if length > self._max_body:
            raise HttpError(413, f"body of {length} bytes is over the {self._max_body}-byte limit")
        return length


def _bearer_admits(token: bytes | None, headers: dict[str, str]) -> bool:
    """Whether ``headers`` carry ``Authorization: Bearer token`` (constant-time comparison)."""
    if token is None:
        return False
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("latin-1"), token)


def _headers(lines: list[str]) -> dict[str, str]:
    """Header lines by lower-case name."""
    headers = {}
    for line in lines:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpError(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
    return headers


async def _read_body(reader: asyncio.StreamReader, length: int) -> bytes:
    """Read ``length`` bytes within 30 s plus the time they take at :data:`BODY_MIN_RATE`."""
    if not length:
        return b""
    deadline = 30.0 + length / BODY_MIN_RATE
    try:
        return await asyncio.wait_for(reader.readexactly(length), deadline)
    except asyncio.IncompleteReadError as exc:
        raise HttpError(400, "connection closed inside the body") from exc
    except TimeoutError as exc:
        raise HttpError(408, f"the body did not arrive within {deadline:.0f} s") from exc


def json_response(model_json: str, status: int = 200) -> Response:
    """A JSON response from a serialised model."""
    return Response(status, model_json.encode())


def _error(status: int, error: ControlErrorCode, message: str) -> Response:
    return Response(status, ErrorReply(error=error, message=message).model_dump_json().encode())
