"""Frame channels: the data plane's small transport interface, and its asyncio implementation.

Handlers only see :class:`FrameChannel`, so unit tests drive them with in-memory fakes.

:class:`FrameProtocol` is an ``asyncio.BufferedProtocol``: the transport (TLS or TCP) writes
received bytes straight into the buffer of the frame being read, sized from the frame's prefix
(after :func:`protocols.frames.frame_length` checked it against the limit), so a large activation
is received with no copy beyond the kernel's and the TLS decryption. Small frames arrive through a
staging buffer. At most ``max_queued`` decoded-but-unread frames are held; then the protocol stops
reading, and TCP pushes back on the sender. Sending, a frame's small parts (prefix, header, small
tensors, padding) are joined into one write, and large tensors go out as views in chunks.

Measured alternative, not kept: blocking ``ssl.SSLSocket`` I/O in a thread per connection. It
saves asyncio's memory-BIO copies, but each frame then crosses threads twice per side, and on a
loaded two-core machine those wake-ups cost more than they save (``bench/handoff.py`` was
slower with it at 64 KiB and 1 MiB, and the MiniLM pipeline's latency too).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import numpy as np

from edge_agent.errors import PeerRejectedError
from edge_agent.net.budgets import ConnectionLimits
from edge_agent.net.frame_budget import UnfinishedBudget
from edge_agent.net.tls import Peer, peer_of
from edge_agent.runtime.checks import Array
from protocols.errors import FrameError, TruncatedFrameError
from protocols.frames import (
    PREFIX_BYTES,
    Frame,
    FrameHeader,
    decode_frame,
    encode_frame_parts,
    frame_length,
)

log = logging.getLogger(__name__)

STAGING_BYTES = 256 * 1024
WRITE_HIGH_WATER = 4 * 1024 * 1024
WRITE_CHUNK = 256 * 1024
COALESCE_BYTES = 64 * 1024


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


class FrameProtocol(asyncio.BufferedProtocol):
    """Receives frames into exactly-sized buffers; see the module docstring."""

    def __init__(
        self, max_frame_bytes: int, max_queued: int = 2, budget: UnfinishedBudget | None = None
    ) -> None:
        self._max = max_frame_bytes
        self._max_queued = max_queued
        self._budget = budget
        self._reserved = 0
        self._reserved_by = ""
        self.peer_key = ""
        """Whose share of ``budget`` this connection's frames reserve: the verified peer's
        name once :meth:`identify` is called, an unnamed share before."""
        self._staging = bytearray(STAGING_BYTES)
        self._staged = 0
        self._frame: memoryview | None = None
        self._filled = 0
        self._frames: collections.deque[bytes | memoryview] = collections.deque()
        self._error: Exception | None = None
        self._eof = False
        self._reading_paused = False
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- receiving --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Remember the transport and set its write high-water mark."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the transport writes next: the rest of the current frame, or the staging area."""
        if self._frame is not None:
            return self._frame[self._filled :]
        return memoryview(self._staging)[self._staged :]

    def buffer_updated(self, nbytes: int) -> None:
        """Account for received bytes; queue completed frames."""
        if self._frame is not None:
            self._filled += nbytes
            if self._filled == len(self._frame):
                self._frames.append(self._frame)
                self._frame = None
                self._release()
        else:
            self._staged += nbytes
            self._parse_staging()
        self._wake()
        if len(self._frames) >= self._max_queued and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()

    def _parse_staging(self) -> None:
        offset = 0
        while self._staged - offset >= PREFIX_BYTES:
            try:
                total = frame_length(
                    bytes(self._staging[offset : offset + PREFIX_BYTES]), self._max
                )
            except FrameError as exc:
                self._fail(exc)
                return
            available = self._staged - offset
            if available >= total:
                self._frames.append(bytes(self._staging[offset : offset + total]))
                offset += total
            else:
                if self._budget is not None and not self._reserve(total, self.peer_key):
                    return
                # np.empty, not bytearray(total): no zero-fill of a buffer about to be overwritten
                frame = np.empty(total, np.uint8).data.cast("B")
                frame[:available] = self._staging[offset : self._staged]
                self._frame, self._filled = frame, available
                offset = self._staged
                break
        rest = self._staged - offset
        if rest and offset:
            self._staging[:rest] = self._staging[offset : self._staged]
        self._staged = rest

    def identify(self, key: str) -> None:
        """Reserve from ``key``'s share from now on. A frame that began with the handshake's
        last bytes (before the server knew the peer) moves to that share, or fails when it
        does not fit there."""
        self.peer_key = key
        if self._budget is None or not self._reserved or self._reserved_by == key:
            return
        total = self._reserved
        self._release()
        self._reserve(total, key)

    def _reserve(self, total: int, key: str) -> bool:
        """Reserve a ``total``-byte frame from ``key``'s share, or fail the connection."""
        assert self._budget is not None
        why = self._budget.reserve(total, key)
        if why is not None:
            self._fail(FrameError(f"a {total}-byte frame does not fit {why}"))
            return False
        self._reserved, self._reserved_by = total, key
        return True

    def _release(self) -> None:
        if self._budget is not None and self._reserved:
            self._budget.give(self._reserved, self._reserved_by)
        self._reserved = 0

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        self._staged = 0
        self._frame = None
        self._release()
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        """The peer finished sending; let the transport close."""
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Wake every waiter; a reader sees the end of stream (or the error)."""
        self._eof = True
        self._release()
        if exc is not None and self._error is None:
            self._error = exc if isinstance(exc, OSError) else ConnectionError(str(exc))
        self._wake()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("connection lost"))
        self._drain_waiters.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def _wake(self) -> None:
        if self._read_waiter is not None and not self._read_waiter.done():
            self._read_waiter.set_result(None)

    async def next_frame(self) -> bytes | memoryview | None:
        """The next complete frame's bytes, None at a clean end; raises on errors."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            if self._eof:
                if self._frame is not None or self._staged:
                    got = self._filled if self._frame is not None else self._staged
                    want = len(self._frame) if self._frame is not None else PREFIX_BYTES
                    raise TruncatedFrameError(f"stream ended after {got} of {want} frame bytes")
                return None
            self._read_waiter = asyncio.get_running_loop().create_future()
            await self._read_waiter
        data = self._frames.popleft()
        if self._reading_paused and self._error is None and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    # -- sending ----------------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The transport's buffer is over the high-water mark."""
        self._write_paused = True

    def resume_writing(self) -> None:
        """The transport's buffer drained."""
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below the high-water mark."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection is closed")
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter


class ProtocolChannel:
    """A :class:`FrameChannel` over a :class:`FrameProtocol` (TLS or plain TCP)."""

    def __init__(self, protocol: FrameProtocol, max_frame_bytes: int, peer: Peer) -> None:
        self._protocol = protocol
        self._max = max_frame_bytes
        self._peer = peer
        self._lock = asyncio.Lock()

    @property
    def peer(self) -> Peer:
        """The verified peer."""
        return self._peer

    async def read(self) -> tuple[Frame, int] | None:
        """Read one frame; see :meth:`FrameChannel.read`."""
        data = await self._protocol.next_frame()
        if data is None:
            return None
        return decode_frame(data, self._max), len(data)

    async def write(self, header: FrameHeader, tensors: Mapping[str, Array]) -> int:
        """Write one frame; see :meth:`FrameChannel.write`."""
        parts = encode_frame_parts(header, tensors)
        transport = self._protocol.transport
        async with self._lock:
            if transport is None or transport.is_closing():
                raise ConnectionResetError(f"connection to {self._peer.name} is closed")
            # Chunked writes: each chunk is encrypted and handed to the socket at once, so the
            # receiver decrypts chunk k while we encrypt chunk k+1 (one big write would encrypt
            # everything before sending anything).
            for view in _coalesced(parts):
                for start in range(0, len(view), WRITE_CHUNK):
                    transport.write(view[start : start + WRITE_CHUNK])
                    await self._protocol.drain()
        return sum(len(p) for p in parts)

    async def close(self) -> None:
        """Close and wait (briefly) for the transport to finish."""
        transport = self._protocol.transport
        if transport is not None and not transport.is_closing():
            transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._protocol.closed), 5.0)
        except TimeoutError:
            log.debug("connection to %s did not close in time; aborting", self._peer.name)
            if transport is not None:
                transport.abort()


def _coalesced(parts: list[bytes | memoryview]) -> list[memoryview]:
    """The frame's parts with runs of small ones (prefix, header, small tensors, padding) joined.

    Every ``transport.write`` costs a TLS record, a system call and a pass through asyncio's SSL
    layer; a frame of MiniLM hidden states has eight parts, and joining the small ones (a copy
    of at most :data:`COALESCE_BYTES` each) leaves two or three writes.
    """
    views: list[memoryview] = []
    small = bytearray()
    for part in parts:
        view = memoryview(part).cast("B")
        if len(view) <= COALESCE_BYTES:
            small += view
            continue
        if small:
            views.append(memoryview(small))
            small = bytearray()
        views.append(view)
    if small:
        views.append(memoryview(small))
    return views


async def open_channel(
    host: str,
    port: int,
    ctx: ssl.SSLContext | None,
    max_frame_bytes: int,
    timeout: float = 10.0,
    unacked_timeout_s: float | None = None,
) -> ProtocolChannel:
    """Connect to a data plane; with ``ctx`` None, plain TCP (benchmarks only).

    With ``unacked_timeout_s`` the kernel drops the connection once sent data has waited that
    long for the peer's acknowledgement (``TCP_USER_TIMEOUT``), and the next write fails.
    """
    loop = asyncio.get_running_loop()
    transport, protocol = await asyncio.wait_for(
        loop.create_connection(lambda: FrameProtocol(max_frame_bytes), host, port, ssl=ctx),
        timeout,
    )
    if unacked_timeout_s is not None:
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(unacked_timeout_s * 1e3))
    if ctx is None:
        peer = Peer(name=f"{host}:{port}", role="")
    else:
        try:
            peer = peer_of(transport.get_extra_info("ssl_object"))
        except PeerRejectedError:
            transport.abort()
            raise
    return ProtocolChannel(protocol, max_frame_bytes, peer)


ChannelHandler = Callable[[ProtocolChannel], Awaitable[None]]


class _Acceptor(asyncio.Protocol):
    """Holds a fresh connection still until its handler task upgrades it to TLS."""

    def __init__(self, start: Callable[[asyncio.Transport], None]) -> None:
        self._start = start

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self._start(transport)


class FrameServer:
    """Accepts data-plane connections, does the TLS handshake, hands channels to a handler.

    Every connection runs in a task this server keeps; :meth:`close` cancels and awaits them.
    Frames still being received on all connections together reserve at most
    ``max_unfinished_bytes`` (default twice the frame limit; see :class:`UnfinishedBudget`),
    those of one peer (by its certificate's name; plain TCP: by address) at most
    ``max_unfinished_per_peer`` (default: all of it).
    A failed handshake (plaintext client, certificate from another CA) is logged and aborted.
    """

    def __init__(
        self,
        handler: ChannelHandler,
        ctx: ssl.SSLContext | None,
        max_frame_bytes: int,
        admit: Callable[[Peer], Peer] | None = None,
        max_unfinished_bytes: int | None = None,
        limits: ConnectionLimits | None = None,
        max_unfinished_per_peer: int | None = None,
    ) -> None:
        """``limits``: open connections in all and per source (over them: closed at once)."""
        self._handler = handler
        self._limits = limits
        self._budget = UnfinishedBudget(
            2 * max_frame_bytes if max_unfinished_bytes is None else max_unfinished_bytes,
            max_unfinished_per_peer,
        )
        self.ctx = ctx
        """The TLS context for new connections (replaced when the agent pairs)."""
        self._max = max_frame_bytes
        self._admit = admit
        self._tasks: set[asyncio.Task[None]] = set()
        self._peers: dict[asyncio.Task[None], Peer] = {}
        self._server: asyncio.Server | None = None
        self.refused = 0

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Acceptor(self._spawn), host, port)
        port_number: int = self._server.sockets[0].getsockname()[1]
        return port_number

    def _spawn(self, transport: asyncio.Transport) -> None:
        limits = self._limits
        source = None if limits is None else limits.admit(transport.get_extra_info("peername"))
        if limits is not None and source is None:
            transport.abort()
            return
        task = asyncio.create_task(self._connection(transport))
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        if limits is not None and source is not None:
            task.add_done_callback(lambda _task: limits.release(source))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("data-plane connection handler failed", exc_info=exc)

    async def _connection(self, raw: asyncio.Transport) -> None:
        address = raw.get_extra_info("peername")
        protocol = FrameProtocol(self._max, budget=self._budget)
        if self.ctx is None:
            raw.set_protocol(protocol)
            protocol.connection_made(raw)
            peer = Peer(name=f"{address}", role="")
            protocol.identify(peer.name)
            raw.resume_reading()
        else:
            loop = asyncio.get_running_loop()
            try:
                transport = await loop.start_tls(
                    raw, protocol, self.ctx, server_side=True, ssl_handshake_timeout=10.0
                )
                assert transport is not None
                protocol.connection_made(transport)  # start_tls does not call it
                peer = peer_of(transport.get_extra_info("ssl_object"))
                # frame bytes may arrive with the handshake's end, before we know the peer
                protocol.identify(peer.name)
                if self._admit is not None:
                    self._admit(peer)
            except (ssl.SSLError, OSError, TimeoutError, PeerRejectedError) as exc:
                self.refused += 1
                log.warning("refused data-plane connection from %s: %s", address, exc)
                raw.abort()
                return
        channel = ProtocolChannel(protocol, self._max, peer)
        task = asyncio.current_task()
        assert task is not None
        self._peers[task] = peer
        try:
            await self._handler(channel)
        finally:
            self._peers.pop(task, None)
            await channel.close()

    def drop(self, predicate: Callable[[Peer], bool]) -> int:
        """Cancel the connections of peers matching ``predicate`` (e.g. just revoked)."""
        doomed = [task for task, peer in self._peers.items() if predicate(peer)]
        for task in doomed:
            task.cancel()
        return len(doomed)

    async def close(self) -> None:
        """Stop listening; cancel and await every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
