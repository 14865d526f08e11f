"""Peers with certificates from another CA, over real TLS sockets in one process.

The stranger's certificate carries a name and role that would be accepted (``a0``, agent): only
the issuing CA is wrong. The data-plane server refuses it during the handshake, before any frame
reaches the handler, while an honest peer's connection that was already open keeps working; an
agent's outgoing link refuses a next agent whose certificate comes from another CA. The control
plane uses the same server context (``test_agent_process`` checks it on a running agent).
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import numpy as np
import pytest
from agent_helpers import TestCA, link_to_server, request_id_recorder, tls_identity

from edge_agent.errors import LinkError
from edge_agent.net.tls import client_context
from protocols.frames import FrameHeader, encode_frame

pytestmark = pytest.mark.timeout(60)


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(250):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_peer_from_another_ca_is_refused_and_others_keep_being_served(tmp_path: Path) -> None:
    ca, other_ca = TestCA(tmp_path / "ca"), TestCA(tmp_path / "other")
    receiver, honest = tls_identity(ca, "a1", tmp_path), tls_identity(ca, "a0", tmp_path)
    stranger = tls_identity(other_ca, "a0", tmp_path / "stranger")  # same name, wrong CA
    received: list[str] = []
    record = request_id_recorder(received)

    async def main() -> None:
        async with link_to_server(record, receiver, honest, "a1") as (link, port):
            tensor = {"t": np.arange(4, dtype=np.float32)}
            await link.send(FrameHeader(request_id="before"), tensor)
            await _until(lambda: received == ["before"], "the honest frame")

            ctx = client_context(stranger)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # the stranger does not even check the server
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                try:
                    writer.write(encode_frame(FrameHeader(request_id="stranger"), tensor))
                    await writer.drain()
                    await asyncio.wait_for(reader.readexactly(1), 5)
                finally:
                    writer.close()

            await link.send(FrameHeader(request_id="after"), tensor)  # the same open connection
            await _until(lambda: received == ["before", "after"], "the honest frame after")

    asyncio.run(main())
    assert "stranger" not in received


def test_a_link_refuses_a_next_agent_from_another_ca(tmp_path: Path) -> None:
    ca, other_ca = TestCA(tmp_path / "ca"), TestCA(tmp_path / "other")
    sender = tls_identity(ca, "a0", tmp_path)
    fake_next = tls_identity(other_ca, "a1", tmp_path / "fake")  # the right name, wrong CA
    reached: list[str] = []
    record = request_id_recorder(reached)

    async def main() -> None:
        peers = link_to_server(record, fake_next, sender, "a1", attempts=2, backoff_s=0.01)
        async with peers as (link, _):
            with pytest.raises(LinkError, match="certificate verify failed"):
                await link.send(FrameHeader(request_id="secret"), {})

    asyncio.run(main())
    assert reached == []
