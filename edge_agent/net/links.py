"""Persistent, self-healing connections to the next agent of the chain."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Protocol

from edge_agent.errors import LinkError, PeerRejectedError
from edge_agent.net.channel import FrameChannel, open_channel
from edge_agent.net.tls import Peer, check_peer
from edge_agent.runtime.checks import Array
from protocols.deploy import ROLE_AGENT, Hop
from protocols.errors import FrameError
from protocols.frames import FrameHeader

log = logging.getLogger(__name__)
UNACKED_TIMEOUT_S = 10.0
"""How long data sent on a link may wait for the peer's acknowledgement before the connection is
dropped. A cut link (cable pulled, port down) sends no RST: without this bound TCP retransmits
into it for about 15 minutes, and when the link returns, frames queued behind the stranded data
wait for the next retransmission, up to two minutes later. A peer that reads nothing for this
long (a zero window) counts as unreachable too."""


class Link(Protocol):
    """Where a stage sends its frames: the next agent (or, from the last, the first)."""

    async def send(self, header: FrameHeader, tensors: Mapping[str, Array]) -> int:
        """Send one frame; raises LinkError when the peer cannot be reached."""
        ...

    async def close(self) -> None:
        """Close the connection."""
        ...


class PeerLink:
    """One outgoing data-plane connection to ``hop``, opened on first use and reopened on failure.

    The peer's certificate must name ``hop.device`` with the agent role. A background task reads
    what the peer sends back on this link (only error frames about refused frames) and logs it.
    """

    def __init__(
        self,
        hop: Hop,
        ctx: ssl.SSLContext,
        max_frame_bytes: int,
        attempts: int = 4,
        backoff_s: float = 0.25,
        admit: Callable[[Peer], Peer] | None = None,
    ) -> None:
        self.hop = hop
        self._admit = admit
        self._ctx = ctx
        self._max = max_frame_bytes
        self._attempts = attempts
        self._backoff = backoff_s
        self._channel: FrameChannel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()

    async def send(self, header: FrameHeader, tensors: Mapping[str, Array]) -> int:
        """Send one frame, reconnecting (with backoff) when the link is down; raises LinkError."""
        last: Exception | None = None
        for attempt in range(self._attempts):
            try:
                channel = await self._connected()
                return await channel.write(header, tensors)
            except (OSError, ssl.SSLError, TimeoutError, PeerRejectedError) as exc:
                last = exc
                log.warning("link to %s failed (attempt %d): %s", self.hop.device, attempt + 1, exc)
                await self._drop()
                await asyncio.sleep(self._backoff * 2**attempt)
        raise LinkError(
            f"cannot reach {self.hop.device} at {self.hop.host}:{self.hop.data_port}: {last}"
        )

    async def _connected(self) -> FrameChannel:
        async with self._connect_lock:
            if self._channel is None:
                channel = await open_channel(
                    self.hop.host,
                    self.hop.data_port,
                    self._ctx,
                    self._max,
                    unacked_timeout_s=UNACKED_TIMEOUT_S,
                )
                try:
                    check_peer(channel.peer, name=self.hop.device, roles={ROLE_AGENT})
                    if self._admit is not None:
                        self._admit(channel.peer)
                except PeerRejectedError:
                    await channel.close()
                    raise
                self._channel = channel
                self._reader = asyncio.create_task(self._read_replies(channel))
            return self._channel

    async def _read_replies(self, channel: FrameChannel) -> None:
        try:
            while (item := await channel.read()) is not None:
                frame, _ = item
                log.warning(
                    "%s refused request %s: %s",
                    self.hop.device,
                    frame.header.request_id,
                    frame.header.failure(),
                )
        except (OSError, ssl.SSLError, FrameError) as exc:
            log.info("link to %s closed: %s", self.hop.device, exc)

    async def _drop(self) -> None:
        channel, reader = self._channel, self._reader
        self._channel, self._reader = None, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        """Close the connection and stop its reader."""
        await self._drop()
