"""What an agent tells the world about itself: its measured profile and its current state."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat

from protocols.base import FrozenModel
from protocols.constants import PROTOCOL_VERSION, SOFTWARE_VERSION

Port = int
ProviderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)]


class DeviceProfile(FrozenModel):
    """A device as measured by its agent at start (cached in its state dir)."""

    device_id: str = Field(pattern=r"^[0-9a-f]{16,64}$")
    """Stable id derived from the agent's public key."""
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    memory_bytes: NonNegativeInt
    """The most memory this agent may use for segments and sessions."""
    gflops: PositiveFloat
    """Compute roof, measured with an ONNX Runtime MatMul micro-benchmark."""
    memory_gbps: PositiveFloat | None = None
    """Memory roof: streaming-read bandwidth in GB/s (10^9 bytes/s), measured with an ONNX
    Runtime matrix-vector product over a matrix larger than the caches; None from agents that
    predate it."""
    cache_bytes: NonNegativeInt | None = None
    """Largest working set read at cache speed (at least twice the memory roof); 0: none."""
    cache_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth of working sets up to ``cache_bytes``, GB/s."""
    op_us: NonNegativeFloat | None = None
    """Fixed cost of one ONNX Runtime operator, microseconds."""
    call_us: NonNegativeFloat | None = None
    """Fixed cost of one run of a segment (``session.run``), microseconds."""
    topk_ns: NonNegativeFloat | None = None
    """Cost of a ``TopK`` per element it selects from, nanoseconds."""
    gemv_gflops: PositiveFloat | None = None
    """Compute roof of a one-row 4-bit weight product (``MatMulNBits``), GFLOP/s."""
    vector_gflops: PositiveFloat | None = None
    """Element-wise roof: counted elements per nanosecond of a transformer block's element-wise
    operators (:mod:`edge_agent.profile.vectorbench`)."""
    int4_rows_exact: bool | None = None
    """Whether this device's ONNX Runtime computes a 4-bit weight product's row bit for bit
    alike alone and in a pass of several (true of its AVX-512 kernel, not its AVX2 one): an
    int4 decoder speculates only on chains of such devices. None from agents that predate it."""
    providers: list[ProviderName] = Field(
        default_factory=lambda: ["CPUExecutionProvider"], max_length=8
    )
    control_port: Port = Field(ge=1, le=65535)
    data_port: Port = Field(ge=1, le=65535)
    cert_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the agent's certificate (DER), or of its public key before pairing."""
    software_version: str = Field(default=SOFTWARE_VERSION, max_length=32)
    protocol_version: NonNegativeInt = PROTOCOL_VERSION


class AgentState(FrozenModel):
    """What changes while an agent runs; re-announced whenever it changes."""

    paired: bool = False
    segment_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    plan_version: NonNegativeInt = 0


class Announcement(FrozenModel):
    """Everything an agent's mDNS TXT record carries."""

    profile: DeviceProfile
    state: AgentState = AgentState()
