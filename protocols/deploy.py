"""``fedshard.deploy/1``: the control plane between the coordinator and an agent.

Pure wire models and codecs; no cryptography and no I/O happen here. Both sides compute the
bytes that get signed with :func:`signing_bytes` and agree on these conventions:

Certificates
    Every certificate comes from the coordinator's CA. Its subject ``CN`` is the device name and
    its ``OU`` is the role: :data:`ROLE_AGENT` or :data:`ROLE_COORDINATOR`. A TLS peer is checked
    against the device name and role the caller expects.

Signatures
    The coordinator signs :func:`signing_bytes` of a :class:`DeployManifest` with its CA key, so
    an agent verifies with the public key of the CA certificate it already trusts:
    ``ecdsa-p256-sha256`` (DER signature) for an EC P-256 CA key, ``ed25519`` for an Ed25519 one.
    The manifest carries the segment's SHA-256, so the signature covers the ONNX bytes too.

Deploy body
    ``POST /v1/deploy`` carries ``b"FSD1" | envelope length (u32 LE) | warm-up length (u64 LE) |
    DeployRequest JSON | warm-up frame | segment ONNX bytes`` (see :func:`encode_deploy_body`).
    The optional warm-up frame is an activation frame (:mod:`protocols.frames`) holding real
    inputs of the segment (``split --verify`` has them); its SHA-256 is in the signed manifest.
    Without one, the agent warms up on all-ones inputs shaped by ``warmup_shapes``.

Data-plane topology
    A chain with a direct return. A requester keeps two connections: one to the first agent and,
    when the chain has more than one agent, one to the last (both mutually authenticated; it
    checks each certificate against the device name in the chain). It sends each request to the
    first agent with ``segment_index = 0`` and *claims* its answer at the last agent with a
    header-only frame of the same ``request_id`` and ``segment_index = len(chain)`` (just after
    the request, so the claim is off the critical path; before it works too). A ``request_id``
    may not contain :data:`ORIGIN_SEPARATOR`.

    The first agent *routes* the request: it forwards it under the id
    ``REQUESTER + ORIGIN_SEPARATOR + request_id``, where ``REQUESTER`` is the device name in the
    requester's verified certificate. Agent ``k`` runs segment ``k`` and sends the names in its
    ``forward`` list on to agent ``k + 1`` with ``segment_index = k + 1``. The last agent returns
    the result, under the requester's own ``request_id`` and with ``segment_index = len(chain)``,
    on the connection whose peer claimed that id with that name: nobody else can claim it. An
    answer that arrives before its claim waits up to 30 s for it (at most 64 such answers). A
    one-agent chain answers on the request's own connection.

    Errors. Once the first agent accepted a request, a failure at any stage becomes an error
    frame (``error`` set) that travels the rest of the chain, skipping compute, and is returned
    like a result. The first agent answers on the requester's connection to it when it refuses a
    request (bad tensors, unknown plan) or cannot reach the second agent; agent ``k > 0`` that
    cannot reach agent ``k + 1`` sends the error frame, routed id and ``segment_index =
    len(chain)``, straight to the last agent. If the last agent is down, the requester's own
    connection to it fails. So every request gets exactly one answer (or a failed connection).
    A requester that got its answer from the first agent releases its claim by sending the claim
    frame again with ``error`` set; claims also end with the connection, and an agent holds at
    most :data:`MAX_CLAIMS` per connection.

Link probes
    A frame whose ``request_id`` starts with :data:`PROBE_PREFIX` is a link probe: the receiving
    agent answers on the same connection with a header-only frame of the same ``request_id``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Final, Literal, Self

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, model_validator

from protocols.base import FrozenModel
from protocols.errors import ControlErrorCode, SchemaError
from protocols.manifest import SegmentEntry, SessionLimits

DEPLOY_FORMAT: Final = "fedshard.deploy/1"
ROLE_AGENT: Final = "agent"
ROLE_COORDINATOR: Final = "coordinator"
ROLE_SUPERLINK: Final = "superlink"
"""The Flower SuperLink's certificate: never accepted on an agent's control or data plane."""
RESERVED_NAMES: Final = frozenset({"coordinator", "superlink", "localhost"})
"""Names no agent may carry: they name the coordinator's own certificates. Agents refuse to
start with one, the coordinator refuses pairing requests for one, and revocation by name applies
to agent-role certificates only, so revoking a rogue that called itself ``coordinator`` cannot
lock out the coordinator."""
PROBE_PREFIX: Final = "probe/"
"""``request_id`` prefix of a link-probe frame."""
ORIGIN_SEPARATOR: Final = "|"
"""Joins the requester's name and its ``request_id`` in a routed request id."""
MAX_CLAIMS: Final = 4096
"""Most unanswered claims an agent holds for one requester connection."""

SIGNATURE_ALGORITHMS: Final = ("ecdsa-p256-sha256", "ed25519")
SignatureAlgorithm = Literal["ecdsa-p256-sha256", "ed25519"]

DEPLOY_MAGIC: Final = b"FSD1"
_BODY_PREFIX = struct.Struct("<4sIQ")
MAX_ENVELOPE_BYTES: Final = 1 << 20

_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Hop(FrozenModel):
    """One agent of the chain: the device name its certificate must carry and its data port."""

    device: str = Field(min_length=1, max_length=63, pattern=_NAME_PATTERN)
    host: str = Field(min_length=1, max_length=253)
    data_port: int = Field(ge=1, le=65535)


class ShapeLimits(FrozenModel):
    """The shapes a deployment was planned for, which every stage enforces on every frame.

    Activation workspace (and ONNX Runtime's arena, which keeps its peak) grows with these
    sizes, so a frame larger than planned would take the agent past its memory budget. A
    frame is refused with :attr:`~protocols.errors.WireErrorCode.SHAPE_LIMIT` when one of its
    tensors has a dimension named in ``dims`` larger than its limit, or when the product of
    the sizes of the ``product_dims`` it carries (batch x sequence: padded tokens) is larger
    than ``product``. The coordinator cuts larger requests into runs that fit.
    """

    dims: dict[str, PositiveInt] = Field(default_factory=dict, max_length=64)
    """Largest size of each named (symbolic) dimension."""
    product_dims: list[str] = Field(default_factory=list, max_length=8)
    product: PositiveInt | None = None
    """Largest product of the sizes of ``product_dims`` in one frame (None: no such limit)."""

    def violation(self, sizes: Mapping[str, int]) -> str | None:
        """Why symbolic dimension ``sizes`` (name to size, of one frame) break the limits."""
        for name, size in sizes.items():
            limit = self.dims.get(name)
            if limit is not None and size > limit:
                return f"dimension {name!r} is {size}, the deployment was planned for {limit}"
        if self.product is not None:
            present = [name for name in self.product_dims if name in sizes]
            total = math.prod(sizes[name] for name in present)
            if present and total > self.product:
                return (
                    f"{' x '.join(present)} is {total}, the deployment was planned "
                    f"for {self.product}"
                )
        return None


class DeployManifest(FrozenModel):
    """Everything the coordinator signs for one agent: its segment and its place in the chain."""

    format: Literal["fedshard.deploy/1"] = DEPLOY_FORMAT
    deployment: str = Field(min_length=1, max_length=128)
    """Free-form id of the deployment (model name and version, for example)."""
    plan_version: PositiveInt
    """Frames carry it; an agent holds at most one segment per plan version."""
    segment: SegmentEntry
    chain: list[Hop] = Field(min_length=1, max_length=1024)
    """Every agent of the ring in segment order; ``chain[segment.index]`` is the receiver."""
    forward: list[str] = Field(min_length=1, max_length=1024)
    """Tensor names this stage sends on: its outputs or pass-through inputs that later stages
    use, or, on the last stage, the results."""
    warmup_shapes: dict[str, list[NonNegativeInt]] = Field(default_factory=dict)
    """Shapes for an all-ones warm-up, by input name, when the body has no warm-up frame;
    free dimensions default to 1."""
    warmup_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the warm-up frame carried in the deploy body, if any."""
    sessions: SessionLimits | None = None
    """Set on every stage of a model with per-session state (a decoder), whether or not this
    segment keeps some (``segment.state``); required when it does."""
    limits: ShapeLimits | None = None
    """The planned shapes every frame must fit (None: only the frame size limit applies)."""

    @model_validator(mode="after")
    def _check_chain(self) -> Self:
        if self.segment.index >= len(self.chain):
            raise ValueError("segment index is outside the chain")
        if self.chain[self.segment.index].device != self.segment.device:
            raise ValueError("chain entry of this segment names another device")
        if len(set(self.forward)) != len(self.forward):
            raise ValueError("forward names a tensor twice")
        if self.segment.state and self.sessions is None:
            raise ValueError("a segment with per-session state needs session limits")
        state = {n for pair in self.segment.state for n in (pair.past, pair.present)}
        if state & set(self.forward):
            raise ValueError("session state never travels: it may not be forwarded")
        return self

    @property
    def is_first(self) -> bool:
        """Whether this stage receives requests from requesters."""
        return self.segment.index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the results."""
        return self.segment.index == len(self.chain) - 1


class DeployRequest(FrozenModel):
    """The JSON envelope of a deploy: the manifest and the coordinator's signature over it."""

    manifest: DeployManifest
    signature_algorithm: SignatureAlgorithm
    signature_hex: str = Field(pattern=r"^[0-9a-f]{2,1024}$")


class FixedCosts(FrozenModel):
    """The fixed costs an agent re-measures next to every warm-up (``fedshard profile``'s
    ``op_us``, ``call_us`` and ``topk_ns``): they move with the load by up to 2.5x, so the
    coordinator's corrections compare a stage with the costs of the same second."""

    op_us: NonNegativeFloat
    call_us: NonNegativeFloat
    topk_ns: NonNegativeFloat


class DeployReport(FrozenModel):
    """An agent's answer to a deploy: the plan's predictions next to what it measured."""

    device: str
    plan_version: PositiveInt
    segment_sha256: str
    predicted_memory_bytes: NonNegativeInt
    measured_memory_bytes: int
    """Resident memory the loaded segment added (RSS after load minus before; may be noisy)."""
    predicted_compute_s: NonNegativeFloat
    load_s: NonNegativeFloat
    warmup_first_s: NonNegativeFloat
    """First run after loading (includes one-off allocations)."""
    warmup_s: NonNegativeFloat
    """Median of the following warm-up runs: the measured stage time."""
    costs: FixedCosts | None = None
    """The fixed costs measured just before loading and just after the warm-up, averaged
    (None from agents that predate it)."""


class UnloadRequest(FrozenModel):
    """Drop the segment of one plan version."""

    plan_version: PositiveInt


class ProbeRequest(FrozenModel):
    """Measure the link from this agent to another agent's data plane."""

    target: Hop
    payload_bytes: PositiveInt = Field(default=4 << 20, le=256 << 20)
    rounds: PositiveInt = Field(default=5, le=100)


class ProbeReport(FrozenModel):
    """Result of a link probe."""

    source: str
    target: str
    latency_ms: NonNegativeFloat
    """Median round trip of a header-only frame, halved."""
    bandwidth_mbps: NonNegativeFloat


class LoadedSegment(FrozenModel):
    """One segment an agent holds, as shown in its status."""

    report: DeployReport
    deployment: str
    segment_index: NonNegativeInt
    chain_length: PositiveInt


class AgentStatus(FrozenModel):
    """``GET /v1/status``."""

    name: str
    device_id: str
    memory_budget_bytes: NonNegativeInt
    memory_committed_bytes: NonNegativeInt
    """Sum of the predicted memory of the loaded segments."""
    resident_memory_bytes: NonNegativeInt
    gflops: float
    memory_gbps: float | None = None
    """Streaming-read bandwidth, GB/s (None from agents that predate it)."""
    cache_bytes: int | None = None
    cache_gbps: float | None = None
    op_us: float | None = None
    call_us: float | None = None
    topk_ns: float | None = None
    gemv_gflops: float | None = None
    vector_gflops: float | None = None
    paired: bool
    segments: list[LoadedSegment] = Field(default_factory=list)


class Revocations(FrozenModel):
    """``POST /v1/revocations``: the complete list of revoked devices (it replaces the last one).

    An agent refuses every TLS peer, on both planes, whose certificate names a revoked device or
    has a revoked SHA-256 fingerprint (hex, over DER).
    """

    names: list[str] = Field(default_factory=list, max_length=100_000)
    fingerprints: list[str] = Field(default_factory=list, max_length=100_000)


class CertificateRenewal(FrozenModel):
    """``POST /v1/certificate`` (coordinator only): a fresh certificate for the agent's own key,
    name and role, from the CA it is paired with; it replaces the one about to expire."""

    cert_pem: str = Field(max_length=16384)


class ErrorReply(FrozenModel):
    """Body of every non-2xx control-plane reply."""

    error: ControlErrorCode
    """What was refused, as a code (never a class name)."""
    message: str


def signing_bytes(manifest: DeployManifest) -> bytes:
    """The canonical bytes the coordinator signs: the format tag, a newline, canonical JSON.

    Canonical JSON is ``json.dumps`` of the manifest's JSON-mode dump with sorted keys, no
    whitespace and ASCII escapes, so every implementation produces identical bytes.
    """
    obj = manifest.model_dump(mode="json")
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return DEPLOY_FORMAT.encode() + b"\n" + text.encode("ascii")


def encode_deploy_body(request: DeployRequest, segment: bytes, warmup: bytes = b"") -> bytes:
    """The body of ``POST /v1/deploy``; ``warmup`` is an encoded activation frame or empty."""
    envelope = request.model_dump_json().encode()
    if len(envelope) > MAX_ENVELOPE_BYTES:
        raise SchemaError(f"deploy envelope is {len(envelope)} bytes, over the limit")
    prefix = _BODY_PREFIX.pack(DEPLOY_MAGIC, len(envelope), len(warmup))
    return b"".join((prefix, envelope, warmup, segment))


def decode_deploy_body(
    body: bytes | memoryview,
) -> tuple[DeployRequest, memoryview, memoryview]:
    """Split a deploy body into its validated envelope, the segment bytes and the warm-up frame.

    Neither the segment nor the warm-up frame is parsed here: the agent hashes them first.
    """
    view = memoryview(body).cast("B")
    if len(view) < _BODY_PREFIX.size:
        raise SchemaError("deploy body is shorter than its prefix")
    magic, length, warmup_length = _BODY_PREFIX.unpack_from(view)
    if magic != DEPLOY_MAGIC:
        raise SchemaError(f"deploy body has bad magic {bytes(magic)!r}")
    start = _BODY_PREFIX.size
    if length > MAX_ENVELOPE_BYTES or start + length + warmup_length > len(view):
        raise SchemaError("deploy body lengths are out of range")
    request = DeployRequest.from_json(bytes(view[start : start + length]))
    warmup_end = start + length + warmup_length
    return request, view[warmup_end:], view[start + length : warmup_end]
