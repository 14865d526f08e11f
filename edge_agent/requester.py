"""A data-plane requester: sends requests to the first agent and awaits results by request id.

Used by tests and benchmarks; the coordinator speaks the same protocol (see protocols.deploy).
Many requests may be in flight on one connection; results come back in any order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from collections.abc import Mapping

from edge_agent.channel import FrameChannel, open_channel
from edge_agent.checks import Array
from edge_agent.errors import LinkError, RemoteRequestError
from edge_agent.tls import check_peer
from protocols.deploy import ROLE_AGENT, Hop
from protocols.errors import FrameError
from protocols.frames import FrameHeader

log = logging.getLogger(__name__)


class Requester:
    """One connection to the first agent of a chain."""

    def __init__(self, channel: FrameChannel, plan_version: int) -> None:
        self._channel = channel
        self._plan_version = plan_version
        self._futures: dict[str, asyncio.Future[dict[str, Array]]] = {}
        self._ids = itertools.count()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls, first: Hop, ctx: ssl.SSLContext, plan_version: int, max_frame_bytes: int = 1 << 30
    ) -> Requester:
        """Open a TLS connection to ``first`` and check its certificate names that device."""
        channel = await open_channel(first.host, first.data_port, ctx, max_frame_bytes)
        check_peer(channel.peer, name=first.device, roles={ROLE_AGENT})
        return cls(channel, plan_version)

    async def infer(
        self, tensors: Mapping[str, Array], request_id: str | None = None
    ) -> dict[str, Array]:
        """Send one request and wait for its result; raises RemoteRequestError or LinkError."""
        rid = request_id or f"r{next(self._ids)}"
        future: asyncio.Future[dict[str, Array]] = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        try:
            await self._channel.write(
                FrameHeader(request_id=rid, plan_version=self._plan_version), tensors
            )
            return await future
        finally:
            self._futures.pop(rid, None)

    async def _read(self) -> None:
        error: Exception = LinkError("connection closed by the agent")
        try:
            while (item := await self._channel.read()) is not None:
                frame, _ = item
                future = self._futures.get(frame.header.request_id)
                if future is None or future.done():
                    log.warning(
                        "unexpected reply %s: %s", frame.header.request_id, frame.header.error
                    )
                elif frame.header.error:
                    future.set_exception(RemoteRequestError(frame.header.error))
                else:
                    future.set_result(dict(frame.tensors))
        except (OSError, ssl.SSLError, FrameError) as exc:
            error = LinkError(f"connection to the first agent failed: {exc}")
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)

    async def close(self) -> None:
        """Close the connection and stop the reader."""
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._channel.close()
