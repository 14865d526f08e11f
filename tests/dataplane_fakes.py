"""A fake agent's data plane for coordinator tests: an in-process TLS frame server with a
certificate from the test's CA, recording what it receives and answering as a test says.

Shared by ``tests/coordinator/test_coordinator_dataplane.py`` and ``tests/e2e/test_failover.py``
(servers started through :data:`SERVERS` are closed by the test that started them).
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.trust.ca import CertificateAuthority
from protocols.deploy import ROLE_AGENT
from protocols.frames import (
    PREFIX_BYTES,
    FrameHeader,
    decode_frame,
    encode_frame,
    frame_length,
)


class FakeAgent:
    """A TLS frame server that records what it receives and answers through ``reply``."""

    def __init__(self, ca: CertificateAuthority, tmp: Path, name: str) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        issued = ca.issue_for_key(key.public_key(), name, ROLE_AGENT)
        cert, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
        cert.write_bytes(issued.pem)
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.ctx.load_cert_chain(cert, key_path)
        self.ctx.load_verify_locations(cafile=str(tmp / "ca_cert.pem"))
        self.received: list[FrameHeader] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ctx)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while True:
                prefix = await reader.readexactly(PREFIX_BYTES)
                rest = await reader.readexactly(frame_length(prefix) - PREFIX_BYTES)
                frame = decode_frame(prefix + rest)
                self.received.append(frame.header)
                await self.on_frame(frame.header, dict(frame.tensors))
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def on_frame(self, header: FrameHeader, tensors: dict[str, np.ndarray]) -> None:
        """Overridden per test."""

    async def send(self, header: FrameHeader, tensors: dict[str, np.ndarray]) -> None:
        writer = self.writers[-1]
        writer.write(encode_frame(header, tensors))
        await writer.drain()


SERVERS: list[asyncio.Server] = []
