"""A data-plane requester: sends requests into a chain and awaits results by request id.

Used by tests and benchmarks; the coordinator speaks the same protocol (see protocols.deploy).
It holds a connection to the first agent (requests go there) and one to the last agent (it
claims each answer there, and the answer comes back there: one hop shorter than a ring).
Many requests may be in flight; results come back in any order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from collections.abc import Mapping, Sequence

from edge_agent.errors import LinkError
from edge_agent.net.channel import FrameChannel, open_channel
from edge_agent.net.tls import check_peer
from edge_agent.net.wire_errors import remote_error
from edge_agent.runtime.checks import Array
from protocols.deploy import ROLE_AGENT, Hop
from protocols.errors import FrameError
from protocols.frames import Frame, FrameHeader, FrameKind

log = logging.getLogger(__name__)


class Requester:
    """Connections to the first and the last agent of a chain (one, for a one-agent chain)."""

    def __init__(
        self,
        first: FrameChannel,
        plan_version: int,
        last: FrameChannel | None = None,
        chain_length: int = 1,
    ) -> None:
        self._first = first
        self._last = last
        self._length = chain_length
        self._plan_version = plan_version
        self._futures: dict[str, asyncio.Future[tuple[Frame, bool]]] = {}
        self._ids = itertools.count()
        self._readers = [asyncio.create_task(self._read(first, "first"))]
        if last is not None:
            self._readers.append(asyncio.create_task(self._read(last, "last")))

    @classmethod
    async def connect(
        cls,
        chain: Hop | Sequence[Hop],
        ctx: ssl.SSLContext,
        plan_version: int,
        max_frame_bytes: int = 1 << 30,
    ) -> Requester:
        """Open TLS connections to the chain's first and last agents (a single Hop: a one-agent
        chain) and check that each certificate names the expected device."""
        hops = [chain] if isinstance(chain, Hop) else list(chain)
        channels: list[FrameChannel] = []
        try:
            for hop in (hops[0], hops[-1]) if len(hops) > 1 else (hops[0],):
                channel = await open_channel(hop.host, hop.data_port, ctx, max_frame_bytes)
                channels.append(channel)
                check_peer(channel.peer, name=hop.device, roles={ROLE_AGENT})
        except BaseException:
            for opened in channels:
                await opened.close()
            raise
        last = channels[1] if len(channels) > 1 else None
        return cls(channels[0], plan_version, last, len(hops))

    async def infer(
        self, tensors: Mapping[str, Array], request_id: str | None = None
    ) -> dict[str, Array]:
        """Send one request and wait for its result; raises RemoteRequestError or LinkError."""
        rid = request_id or f"r{next(self._ids)}"
        future: asyncio.Future[tuple[Frame, bool]] = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        try:
            # The request first: the claim is off the critical path (an answer that reaches the
            # last agent before its claim waits there for it).
            request = FrameHeader(request_id=rid, plan_version=self._plan_version)
            await _send(self._first, "first", request, tensors)
            if self._last is not None:
                await _send(self._last, "last", self._claim(rid), {})
            frame, from_first = await future
        finally:
            self._futures.pop(rid, None)
        if from_first and self._last is not None:
            await self._release(rid)
        if frame.header.failed:
            raise remote_error(frame.header)
        return dict(frame.tensors)

    def _claim(self, rid: str, kind: FrameKind = FrameKind.DATA) -> FrameHeader:
        return FrameHeader(
            request_id=rid, segment_index=self._length, plan_version=self._plan_version, kind=kind
        )

    async def _release(self, rid: str) -> None:
        assert self._last is not None
        try:
            await self._last.write(self._claim(rid, FrameKind.RELEASE), {})
        except (OSError, ssl.SSLError) as exc:
            log.info("could not release the claim on %s: %s", rid, exc)

    async def _read(self, channel: FrameChannel, which: str) -> None:
        error: Exception = LinkError(f"connection closed by the {which} agent")
        try:
            while (item := await channel.read()) is not None:
                frame, _ = item
                future = self._futures.get(frame.header.request_id)
                if future is None or future.done():
                    log.warning(
                        "unexpected reply %s: %s", frame.header.request_id, frame.header.kind
                    )
                else:
                    future.set_result((frame, channel is self._first))
        except (OSError, ssl.SSLError, FrameError) as exc:
            error = LinkError(f"connection to the {which} agent failed: {exc}")
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Close the connections and stop the readers."""
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self._first.close()
        if self._last is not None:
            await self._last.close()


async def _send(
    channel: FrameChannel, which: str, header: FrameHeader, tensors: Mapping[str, Array]
) -> None:
    try:
        await channel.write(header, tensors)
    except (OSError, ssl.SSLError) as exc:
        raise LinkError(f"connection to the {which} agent failed: {exc}") from exc
