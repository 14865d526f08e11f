"""The coordinator's own links to the agents: where requests go in and results come back.

The planner counts the hand-off of each request's input to the first stage and of the result
back from the last stage to the coordinator (``DeviceList.requester``). The coordinator measures
those links the way agents measure the links between them (``edge_agent.net.probe``): on a
data-plane connection to the agent, round trips of header-only probe frames give the latency,
round trips of one large probe frame the bandwidth. The agent answers every probe frame with a
header-only frame, so the large frame's round trip minus the small one's is the payload's time
on the link. The large frame travels toward the agent; links are taken as symmetric, as between
agents.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.config import Timeouts
from coordinator.errors import AgentError
from coordinator.fleet.links import MIN_BANDWIDTH_MBPS, PROBE_BYTES
from coordinator.fleet.registry import DeviceRecord
from coordinator.transport.dataplane import DataPlane, FrameConnection
from protocols.deploy import PROBE_PREFIX, Hop
from protocols.frames import Frame, FrameHeader
from protocols.links import RequesterLink, probe_estimate

PROBE_ROUNDS = 6


class ProbeConnection:
    """A data-plane connection that sends probe frames and waits for their answers."""

    def __init__(self, reply_s: float = Timeouts.link_reply_s) -> None:
        """``reply_s``: how long one probe frame's answer is awaited."""
        self._reply_s = reply_s
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._connection: FrameConnection | None = None

    async def open(self, hop: Hop, ctx: ssl.SSLContext) -> None:
        """Connect to ``hop``'s data plane (its certificate must name that device)."""
        self._connection = await FrameConnection.open(hop, ctx, self._on_frame, self._on_close)

    async def round_trip(self, tensors: Mapping[str, npt.NDArray[Any]]) -> float:
        """Seconds from sending one probe frame to its answer."""
        if self._connection is None:
            raise AgentError("the probe connection is not open")
        request_id = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        answered = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answered
        start = time.perf_counter()
        try:
            await self._connection.send(FrameHeader(request_id=request_id), tensors)
            await asyncio.wait_for(answered, self._reply_s)
        except TimeoutError as exc:
            raise AgentError(f"no answer to a link probe within {self._reply_s:.0f} s") from exc
        finally:
            self._waiting.pop(request_id, None)
        return time.perf_counter() - start

    async def close(self) -> None:
        """Close the connection."""
        if self._connection is not None:
            await self._connection.close()

    def _on_frame(self, frame: Frame) -> None:
        answered = self._waiting.get(frame.header.request_id)
        if answered is not None and not answered.done():
            answered.set_result(None)

    def _on_close(self, error: Exception) -> None:
        for answered in self._waiting.values():
            if not answered.done():
                answered.set_exception(error)


async def probe_agent(
    hop: Hop,
    ctx: ssl.SSLContext,
    payload_bytes: int = PROBE_BYTES,
    rounds: int = PROBE_ROUNDS,
    reply_s: float = Timeouts.link_reply_s,
) -> RequesterLink:
    """The link between the coordinator and ``hop``'s agent; raises :class:`AgentError`."""
    probe = ProbeConnection(reply_s)
    await probe.open(hop, ctx)
    try:
        small = [await probe.round_trip({}) for _ in range(rounds)]
        payload = {"payload": np.zeros(payload_bytes, dtype=np.uint8)}
        await probe.round_trip(payload)  # the first large frame also grows the TCP window
        large = [await probe.round_trip(payload) for _ in range(max(1, rounds // 2))]
    finally:
        await probe.close()
    latency_ms, bandwidth_mbps = probe_estimate(small, large, payload_bytes)
    return RequesterLink(
        device=hop.device,
        bandwidth_mbps=max(bandwidth_mbps, MIN_BANDWIDTH_MBPS),
        latency_ms=latency_ms,
    )


def requester_probe(
    plane: DataPlane, ctx: ssl.SSLContext, timeouts: Timeouts | None = None
) -> Callable[[DeviceRecord], RequesterLink]:
    """Measures the coordinator's link to one paired agent on the data-plane loop."""
    timeouts = timeouts or Timeouts()
    timeout_s = timeouts.link_probe_s

    def probe(record: DeviceRecord) -> RequesterLink:
        profile = record.announcement.profile
        hop = Hop(device=record.name, host=record.host, data_port=profile.data_port)
        try:
            return plane.call(probe_agent(hop, ctx, reply_s=timeouts.link_reply_s), timeout_s)
        except TimeoutError as exc:
            raise AgentError(
                f"probing the link to {record.name} took over {timeout_s:.0f} s"
            ) from exc

    return probe
