"""The API's HTTP server: uvicorn with deadlines and caps against slow and many connections.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not one that sends a
request head a byte at a time: 1,500 half-sent heads stayed open for 40 s and more. Here the
HTTP protocol (uvicorn's h11 one, whose parser also caps an incomplete head at
``h11_max_incomplete_event_size``) adds:

- a deadline for every request head, :data:`HEAD_DEADLINE_S` from when it is awaited (the
  connection opened, or the previous response ended), answered 408 and closed;
- at most :data:`MAX_HEAD_BYTES` received while a head is incomplete (431 and closed);
- at most :data:`MAX_PER_SOURCE` open connections from one address (further ones are closed
  at once), and ``limit_concurrency`` in all (uvicorn answers 503 beyond it).

A request's body and the app's work are not under the head deadline: the API guard
(:mod:`coordinator.http.guard`) refuses unauthenticated and oversized bodies before reading
them, and whoever holds the token is trusted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
HEAD_DEADLINE_S = 10.0
MAX_HEAD_BYTES = 64 << 10
MAX_PER_SOURCE = 256
MAX_CONNECTIONS = 4096
"""uvicorn's ``limit_concurrency``: connections (and tasks) in all before it answers 503."""
KEEP_ALIVE_S = 5.0
_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a head size cap and a per-source cap."""

    sources: ClassVar[Counter[str]] = Counter()
    """Open connections by source address: one counter per server (see :func:`api_server`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._source: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the source; close at once when it has too many open; start the head clock."""
        super().connection_made(transport)
        source = self.client[0] if self.client else "?"
        if self.sources[source] >= MAX_PER_SOURCE:
            log.warning("refused a connection from %s: %d open", source, MAX_PER_SOURCE)
            transport.close()
            return
        self._source = source
        self.sources[source] += 1
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        """Uncount the source and stop the head clock."""
        if self._source is not None:
            self.sources[self._source] -= 1
            if self.sources[self._source] <= 0:
                del self.sources[self._source]
            self._source = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; bytes that leave the head incomplete count against the cap."""
        super().data_received(data)
        if not self._awaiting_head():
            self._head_bytes = 0
        else:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self._refuse(_TOO_LARGE)
                return
        self._rearm()

    def on_response_complete(self) -> None:
        """The next head is awaited from now (keep-alive)."""
        super().on_response_complete()
        self._head_bytes = 0
        self._rearm()

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _rearm(self) -> None:
        """Run the head clock exactly while a head is awaited."""
        if self._awaiting_head() and not self.transport.is_closing():
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(HEAD_DEADLINE_S, self._head_expired)
        else:
            self._disarm()

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self._refuse(_TIMEOUT)

    def _refuse(self, answer: bytes) -> None:
        self._disarm()
        self.transport.write(answer)
        self.transport.close()


def api_server(app: Any, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for ``app`` with the guarded protocol (its own source counter)."""
    protocol = type("ApiProtocol", (GuardedH11Protocol,), {"sources": Counter()})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=protocol,
        timeout_keep_alive=int(KEEP_ALIVE_S),
        limit_concurrency=MAX_CONNECTIONS,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    return uvicorn.Server(config)
