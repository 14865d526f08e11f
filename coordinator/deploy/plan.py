"""Deploy planning, pure parts: the device list the planner sees, segment wiring, signing.

No sockets here: the deployer (:mod:`coordinator.deploy.deployer`) gathers live statuses and links,
these functions turn them into a :class:`~protocols.devices.DeviceList`, the per-segment
``forward`` lists, and signed :class:`~protocols.deploy.DeployRequest` bodies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.errors import DeployError
from protocols.deploy import (
    DeployManifest,
    DeployRequest,
    Hop,
    ShapeLimits,
    encode_deploy_body,
    signing_bytes,
)
from protocols.devices import DeviceList, DeviceSpec
from protocols.frames import FrameHeader, encode_frame
from protocols.links import Link as DeviceLink
from protocols.links import Requester, RequesterLink
from protocols.manifest import Manifest
from protocols.roofs import roof_values

Signer = Callable[[bytes], bytes]
DEFAULT_BANDWIDTH_MBPS = 1000.0


@dataclass(frozen=True)
class LiveDevice:
    """A trusted, online agent as the planner should see it now."""

    name: str
    budget_bytes: int
    committed_bytes: int
    """Predicted memory of the segments it already holds (the live version stays loaded)."""
    gflops: float
    host: str
    control_port: int
    data_port: int
    memory_gbps: float | None = None
    """Memory roof (None from agents that predate it: priced by FLOPs alone)."""
    cache_bytes: int = 0
    cache_gbps: float | None = None
    op_us: float = 0.0
    call_us: float = 0.0
    topk_ns: float = 0.0
    gemv_gflops: float | None = None
    """One-row 4-bit product roof (None from agents that predate it: priced at ``gflops``)."""
    vector_gflops: float | None = None
    """Element-wise roof (None from agents that predate it: priced at ``gflops``)."""
    correction: float = 1.0
    """The measured/predicted correction already applied to the roofs above
    (:mod:`coordinator.deploy.stage_timing`)."""


def device_list(
    devices: Sequence[LiveDevice],
    links: Sequence[DeviceLink],
    memory_caps: Mapping[str, int],
    strict: bool = True,
    requester: Sequence[RequesterLink] | None = None,
) -> DeviceList:
    """``DEVICES.json`` for the planner: free memory (capped by the operator), GFLOP/s, links.

    A device's memory is what its budget leaves beside the segments already loaded, since a
    new version is loaded next to the live one. Links between devices not in the list are
    dropped; unmeasured pairs fall back to the device bandwidth. With ``strict``, caps naming
    a device that is not in the list are refused; otherwise they are ignored (a re-plan while
    a device is away). ``requester``: the coordinator's measured links to the devices, so the
    planner counts inputs in and results back (None: it does not).
    """
    unknown = sorted(set(memory_caps) - {d.name for d in devices})
    if unknown and strict:
        raise DeployError(f"memory caps name devices that are not paired and online: {unknown}")
    specs = []
    for device in devices:
        free = max(0, device.budget_bytes - device.committed_bytes)
        cap = memory_caps.get(device.name)
        specs.append(
            DeviceSpec(
                name=device.name,
                memory_bytes=min(free, cap) if cap is not None else free,
                gflops=device.gflops,
                bandwidth_mbps=DEFAULT_BANDWIDTH_MBPS,
                **roof_values(device),
            )
        )
    names = {d.name for d in devices}
    kept = [link for link in links if link.a in names and link.b in names]
    if not specs:
        raise DeployError("no paired agent is online")
    if requester is None:
        return DeviceList(devices=specs, links=kept)
    to_devices = [link for link in requester if link.device in names]
    return DeviceList(devices=specs, links=kept, requester=Requester(links=to_devices))


def forward_names(manifest: Manifest, index: int) -> list[str]:
    """What segment ``index`` sends on: names later segments (or the results) need that the
    model inputs and segments ``0..index`` make available. Per-session state (a decoder's KV
    cache) stays on its stage and is never sent."""
    segments = manifest.segments
    state = {n for s in segments for pair in s.state for n in (pair.past, pair.present)}
    if index == len(segments) - 1:
        later = {o.name for o in manifest.model.outputs}
    else:
        later = {n for s in segments[index + 1 :] for n in s.inputs}
    available = {i.name for i in manifest.model.inputs}
    available |= {n for s in segments[: index + 1] for n in s.outputs}
    return sorted((later & available) - state)


def deploy_bodies(
    manifest: Manifest,
    chain: Sequence[Hop],
    segment_dir: Path,
    warmups: Sequence[Mapping[str, np.ndarray[Any, Any]]],
    deployment: str,
    plan_version: int,
    sign: Signer,
    limits: ShapeLimits | None = None,
) -> list[Callable[[], bytes]]:
    """One signed ``POST /v1/deploy`` body per segment, each with its own warm-up frame, made
    when called: a segment's file is read only as it is pushed, so the coordinator holds one
    segment per host lane at a time, not the whole model (the envelope is signed here)."""
    bodies = []
    for seg, warm in zip(manifest.segments, warmups, strict=True):
        frame = encode_frame(FrameHeader(request_id=f"warmup-{seg.index}"), warm)
        signed = DeployManifest(
            deployment=deployment,
            plan_version=plan_version,
            segment=seg,
            chain=list(chain),
            forward=forward_names(manifest, seg.index),
            warmup_sha256=hashlib.sha256(frame).hexdigest(),
            sessions=manifest.sessions,
            limits=limits,
        )
        request = DeployRequest(
            manifest=signed,
            signature_algorithm="ecdsa-p256-sha256",
            signature_hex=sign(signing_bytes(signed)).hex(),
        )
        bodies.append(_body(request, segment_dir / seg.file, frame))
    return bodies


def _body(request: DeployRequest, segment: Path, frame: bytes) -> Callable[[], bytes]:
    def make() -> bytes:
        return encode_deploy_body(request, segment.read_bytes(), frame)

    return make


def max_abs_diff(
    got: Mapping[str, np.ndarray[Any, Any]], want: Mapping[str, np.ndarray[Any, Any]]
) -> float:
    """Largest absolute difference over the outputs ``want`` names (inf if one is missing)."""
    worst = 0.0
    for name, expected in want.items():
        if name not in got or got[name].shape != expected.shape:
            return float("inf")
        diff = np.abs(got[name].astype(np.float64) - expected.astype(np.float64))
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
    return worst
