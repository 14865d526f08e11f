"""Link probe: latency and bandwidth from this agent to another agent's data plane."""

from __future__ import annotations

import ssl
import time
import uuid

import numpy as np

from edge_agent.errors import LinkError
from edge_agent.net.channel import FrameChannel, open_channel
from edge_agent.net.tls import check_peer
from protocols.deploy import PROBE_PREFIX, ROLE_AGENT, ProbeReport, ProbeRequest
from protocols.frames import FrameHeader
from protocols.links import probe_estimate


async def probe_link(
    source: str, request: ProbeRequest, ctx: ssl.SSLContext, max_frame_bytes: int
) -> ProbeReport:
    """Round trips of header-only frames (latency), then of one large frame (bandwidth).

    The target answers every probe frame with a header-only frame, so the large frame's round
    trip minus the small one's is the time the payload took on the link.
    """
    target = request.target
    try:
        channel = await open_channel(target.host, target.data_port, ctx, max_frame_bytes)
    except (OSError, ssl.SSLError, TimeoutError) as exc:
        raise LinkError(f"cannot reach {target.device}: {exc}") from exc
    try:
        check_peer(channel.peer, name=target.device, roles={ROLE_AGENT})
        small = [await _round_trip(channel, {}) for _ in range(request.rounds)]
        payload = {"payload": np.zeros(request.payload_bytes, dtype=np.uint8)}
        await _round_trip(channel, payload)
        large = [await _round_trip(channel, payload) for _ in range(max(1, request.rounds // 2))]
    except (OSError, ssl.SSLError) as exc:
        raise LinkError(f"probe to {target.device} failed: {exc}") from exc
    finally:
        await channel.close()
    latency_ms, bandwidth_mbps = probe_estimate(small, large, request.payload_bytes)
    return ProbeReport(
        source=source, target=target.device, latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps
    )


async def _round_trip(channel: FrameChannel, tensors: dict[str, np.ndarray]) -> float:
    request_id = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    start = time.perf_counter()
    await channel.write(FrameHeader(request_id=request_id), tensors)
    reply = await channel.read()
    elapsed = time.perf_counter() - start
    if reply is None or reply[0].header.request_id != request_id:
        raise LinkError("the target did not answer the probe")
    return elapsed
