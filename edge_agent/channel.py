"""Frame channels: the small transport interface of the data plane, and its asyncio streams form.

Handlers only see :class:`FrameChannel`, so unit tests drive them with in-memory fakes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from typing import Protocol

from edge_agent.checks import Array
from edge_agent.tls import Peer, peer_of
from protocols.errors import TruncatedFrameError
from protocols.frames import (
    PREFIX_BYTES,
    Frame,
    FrameHeader,
    decode_frame,
    encode_frame_parts,
    frame_length,
)

log = logging.getLogger(__name__)


class FrameChannel(Protocol):
    """One bidirectional connection that carries frames."""

    @property
    def peer(self) -> Peer:
        """Who is on the other end (from the verified certificate)."""
        ...

    async def read(self) -> tuple[Frame, int] | None:
        """The next frame and its size in bytes, or None on a clean end of stream.

        Raises FrameError subclasses for a frame that is over the limit, cut short or malformed.
        """
        ...

    async def write(self, header: FrameHeader, tensors: Mapping[str, Array]) -> int:
        """Send one frame (serialised with other writers), wait for buffer space; returns bytes."""
        ...

    async def close(self) -> None:
        """Close the connection."""
        ...


class StreamChannel:
    """A :class:`FrameChannel` over an asyncio stream pair (TLS or plain TCP)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_frame_bytes: int,
        peer: Peer | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._max = max_frame_bytes
        self._lock = asyncio.Lock()
        ssl_object = writer.get_extra_info("ssl_object")
        self._peer = peer if peer is not None else peer_of(ssl_object)

    @property
    def peer(self) -> Peer:
        """The verified peer."""
        return self._peer

    async def read(self) -> tuple[Frame, int] | None:
        """Read one frame; see :meth:`FrameChannel.read`."""
        try:
            prefix = await self._reader.readexactly(PREFIX_BYTES)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise TruncatedFrameError(
                f"stream ended {len(exc.partial)} bytes into a frame prefix"
            ) from None
        total = frame_length(prefix, self._max)
        buffer = bytearray(total)
        buffer[:PREFIX_BYTES] = prefix
        try:
            body = await self._reader.readexactly(total - PREFIX_BYTES)
        except asyncio.IncompleteReadError as exc:
            raise TruncatedFrameError(
                f"stream ended after {PREFIX_BYTES + len(exc.partial)} of {total} frame bytes"
            ) from None
        buffer[PREFIX_BYTES:] = body
        del body
        return decode_frame(buffer, self._max), total

    async def write(self, header: FrameHeader, tensors: Mapping[str, Array]) -> int:
        """Write one frame; see :meth:`FrameChannel.write`."""
        parts = encode_frame_parts(header, tensors)
        async with self._lock:
            self._writer.writelines(parts)
            await self._writer.drain()
        return sum(len(p) for p in parts)

    async def close(self) -> None:
        """Close and wait for the transport to finish (errors on a dying link are expected)."""
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            log.debug("connection to %s closed uncleanly: %s", self._peer.name, exc)


async def open_channel(
    host: str, port: int, ctx: ssl.SSLContext | None, max_frame_bytes: int, timeout: float = 10.0
) -> StreamChannel:
    """Connect to a data plane; with ``ctx`` None, plain TCP (benchmarks only)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=ctx, limit=1 << 20), timeout
    )
    peer = Peer(name=f"{host}:{port}", role="") if ctx is None else None
    return StreamChannel(reader, writer, max_frame_bytes, peer)
