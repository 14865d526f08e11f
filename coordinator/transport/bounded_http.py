"""One HTTPS exchange with an agent under a total deadline and a reply-size cap.

The coordinator reads hosts that mDNS merely suggested (unpaired agents' pairing offers) and
paired agents' control planes. Per-operation socket timeouts do not bound a host that drips one
byte just inside each timeout, and ``http.client``'s ``read()`` takes whatever size it is sent;
so here one timer shuts the socket down when the whole exchange (connect, TLS handshake,
request, reply) passes its deadline, and a reply over ``max_reply_bytes`` is refused after
reading at most that many bytes of it.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
from collections.abc import Callable

from coordinator.errors import AgentError

MAX_REPLY_BYTES = 4 << 20
"""Largest control-plane reply the coordinator reads (status, reports, metrics)."""
MAX_OFFER_BYTES = 64 << 10
"""Largest reply from an unpaired host (a pairing offer is a few KiB)."""
_CHUNK = 64 << 10


class ExchangeError(AgentError):
    """The exchange failed: connection, TLS, HTTP, its deadline or its size cap."""


class ReplyTooLargeError(ExchangeError):
    """An agent's reply was over the size the coordinator reads."""


def exchange(
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    request: tuple[str, str, bytes],
    deadline_s: float,
    max_reply_bytes: int,
    check: Callable[[ssl.SSLSocket], object] | None = None,
) -> tuple[int, bytes]:
    """``(status, body)`` of one request; raises ExchangeError (also on deadline or size), or
    what ``check`` raises for the peer's certificate."""
    method, path, body = request
    try:
        raw = socket.create_connection((host, port), timeout=deadline_s)
    except OSError as exc:
        raise ExchangeError(str(exc)) from exc
    expired = threading.Event()
    current: list[socket.socket] = [raw]
    """The socket to cut: wrapping for TLS detaches ``raw`` from its descriptor."""

    def cut() -> None:
        expired.set()
        with contextlib.suppress(OSError):
            current[0].shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=deadline_s)
    try:
        sock = ctx.wrap_socket(raw, server_hostname=host if ctx.check_hostname else None)
        current[0] = sock
        if expired.is_set():
            raise ExchangeError(f"no TLS handshake within {deadline_s:g} s")
        conn.sock = sock
        if check is not None:
            check(sock)
        headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, _read_capped(response, max_reply_bytes)
    except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise ExchangeError(f"no complete answer within {deadline_s:g} s") from exc
        raise ExchangeError(str(exc)) from exc
    finally:
        timer.cancel()
        conn.close()
        raw.close()


def _read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ReplyTooLargeError(f"a reply of {declared} bytes is over the {limit}-byte limit")
    parts: list[bytes] = []
    total = 0
    while chunk := response.read(min(_CHUNK, limit + 1 - total)):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ReplyTooLargeError(f"a reply over the {limit}-byte limit")
    return b"".join(parts)
