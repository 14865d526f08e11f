"""Outgoing links over real TLS sockets in one process: reconnect, name check, requester errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from agent_helpers import (
    TestCA,
    link_to_server,
    peer_link,
    request_id_recorder,
    start_frame_server,
    tls_identity,
)

from edge_agent.errors import LinkError
from edge_agent.net.channel import FrameChannel
from protocols.frames import FrameHeader


def test_link_reconnects_after_the_peer_restarts(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    sender, receiver = tls_identity(ca, "a0", tmp_path), tls_identity(ca, "a1", tmp_path)
    received: list[str] = []
    record = request_id_recorder(received)

    async def main() -> None:
        server, port = await start_frame_server(record, receiver)
        link = peer_link(sender, "a1", port, backoff_s=0.05)
        payload = {"t": np.arange(4, dtype=np.float32)}
        await link.send(FrameHeader(request_id="one"), payload)
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.02)
        await server.close()  # the next agent goes away ...
        server, _ = await start_frame_server(record, receiver, port)  # ... and comes back
        for i in range(3):  # the first write may still land in the dead socket's buffer
            await link.send(FrameHeader(request_id=f"again{i}"), payload)
            await asyncio.sleep(0.05)
        for _ in range(100):
            if any(r.startswith("again") for r in received):
                break
            await asyncio.sleep(0.02)
        await link.close()
        await server.close()

    asyncio.run(main())
    assert received[0] == "one" and any(r.startswith("again") for r in received)


def test_link_refuses_a_peer_with_another_name(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    sender, impostor = tls_identity(ca, "a0", tmp_path), tls_identity(ca, "a9", tmp_path)

    async def main() -> None:
        async def ignore(channel: FrameChannel) -> None:
            await channel.read()

        peers = link_to_server(ignore, impostor, sender, "a1", attempts=2, backoff_s=0.01)
        async with peers as (link, _):
            with pytest.raises(LinkError, match="expected device 'a1'"):
                await link.send(FrameHeader(request_id="x"), {})

    asyncio.run(main())


def test_link_gives_up_when_nobody_listens(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    sender = tls_identity(ca, "a0", tmp_path)

    async def main() -> None:
        server, port = await start_frame_server(lambda c: asyncio.sleep(0), sender)
        await server.close()
        link = peer_link(sender, "a1", port, attempts=2, backoff_s=0.01)
        with pytest.raises(LinkError, match="cannot reach a1"):
            await link.send(FrameHeader(request_id="x"), {})
        await link.close()

    asyncio.run(main())
