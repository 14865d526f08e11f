"""Fakes and a segment store for unit tests of the edge agent's data plane (no sockets):
shared by tests/edge_agent/ and tests of hostile frames and segments."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from agent_helpers import TestCA

from edge_agent.config import RuntimeConfig
from edge_agent.net.tls import Peer
from edge_agent.runtime.segments import SegmentStore
from edge_agent.trust.identity import Identity
from protocols.deploy import Hop
from protocols.frames import Frame, FrameHeader, decode_frame, encode_frame

CHAIN = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
"""Three agents on localhost, as the tiny chain's manifests name them."""


def segment_store(ca: TestCA, budget: int = 64 << 20, name: str = "a0") -> SegmentStore:
    """A store verifying with ``ca``'s key, its segment files in the CA's directory."""
    identity = Identity(
        name=name,
        device_id="0" * 32,
        cert_fingerprint="0" * 64,
        paired=True,
        cert_path=Path("unused"),
        key_path=Path("unused"),
        ca_path=ca.ca_path,
        ca_public_key=ca.cert.public_key(),  # type: ignore[arg-type]
    )
    return SegmentStore(identity, budget, RuntimeConfig(), ca.directory / f"segments-{name}")


class FakeChannel:
    """Incoming frames from a queue; sent frames recorded."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.incoming: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.sent: asyncio.Queue[Frame] = asyncio.Queue()
        self.closed = False

    async def read(self) -> tuple[Frame, int] | None:
        data = await self.incoming.get()
        return None if data is None else (decode_frame(data), len(data))

    async def write(self, header: FrameHeader, tensors: Mapping[str, np.ndarray]) -> int:
        data = encode_frame(header, tensors)
        await self.sent.put(decode_frame(data))
        return len(data)

    async def close(self) -> None:
        self.closed = True


class FakeLink:
    """Frames sent to ``hop`` recorded in ``log``."""

    def __init__(self, hop: Hop, log: list[tuple[str, Frame]]) -> None:
        self.hop, self.log = hop, log

    async def send(self, header: FrameHeader, tensors: Mapping[str, np.ndarray]) -> int:
        self.log.append((self.hop.device, decode_frame(encode_frame(header, tensors))))
        return 0

    async def close(self) -> None:
        pass
