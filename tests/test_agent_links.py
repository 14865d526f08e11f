"""Outgoing links over real TLS sockets in one process: reconnect, name check, requester errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from agent_helpers import TestCA

from edge_agent.channel import FrameChannel, FrameServer
from edge_agent.config import AgentConfig, TlsFiles
from edge_agent.errors import LinkError
from edge_agent.identity import Identity, load_identity
from edge_agent.links import PeerLink
from edge_agent.tls import client_context, server_context
from protocols.deploy import Hop
from protocols.frames import FrameHeader


def _identity(ca: TestCA, name: str, tmp: Path) -> Identity:
    cert, key = ca.issue(name)
    return load_identity(
        AgentConfig(name, 1 << 20, tmp / name, tls=TlsFiles(ca.ca_path, cert, key))
    )


def test_link_reconnects_after_the_peer_restarts(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    sender, receiver = _identity(ca, "a0", tmp_path), _identity(ca, "a1", tmp_path)
    received: list[str] = []

    async def record(channel: FrameChannel) -> None:
        while (item := await channel.read()) is not None:
            received.append(item[0].header.request_id)

    async def main() -> None:
        server = FrameServer(record, server_context(receiver), 1 << 20)
        port = await server.start("127.0.0.1", 0)
        link = PeerLink(
            Hop(device="a1", host="127.0.0.1", data_port=port),
            client_context(sender),
            1 << 20,
            backoff_s=0.05,
        )
        payload = {"t": np.arange(4, dtype=np.float32)}
        await link.send(FrameHeader(request_id="one"), payload)
        for _ in range(100):
            if received:
                break
            await asyncio.sleep(0.02)
        await server.close()  # the next agent goes away ...
        server = FrameServer(record, server_context(receiver), 1 << 20)
        await server.start("127.0.0.1", port)  # ... and comes back on the same port
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
    sender, impostor = _identity(ca, "a0", tmp_path), _identity(ca, "a9", tmp_path)

    async def main() -> None:
        async def ignore(channel: FrameChannel) -> None:
            await channel.read()

        server = FrameServer(ignore, server_context(impostor), 1 << 20)
        port = await server.start("127.0.0.1", 0)
        link = PeerLink(
            Hop(device="a1", host="127.0.0.1", data_port=port),
            client_context(sender),
            1 << 20,
            attempts=2,
            backoff_s=0.01,
        )
        try:
            with pytest.raises(LinkError, match="expected device 'a1'"):
                await link.send(FrameHeader(request_id="x"), {})
        finally:
            await link.close()
            await server.close()

    asyncio.run(main())


def test_link_gives_up_when_nobody_listens(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    sender = _identity(ca, "a0", tmp_path)

    async def main() -> None:
        server = FrameServer(lambda c: asyncio.sleep(0), server_context(sender), 1 << 20)
        port = await server.start("127.0.0.1", 0)
        await server.close()
        link = PeerLink(
            Hop(device="a1", host="127.0.0.1", data_port=port),
            client_context(sender),
            1 << 20,
            attempts=2,
            backoff_s=0.01,
        )
        with pytest.raises(LinkError, match="cannot reach a1"):
            await link.send(FrameHeader(request_id="x"), {})
        await link.close()

    asyncio.run(main())
