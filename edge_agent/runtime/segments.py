"""Accepting segments: verify, check the budget, load, measure, warm up; and the loaded set.

The order is the security argument: the SHA-256 of the segment bytes and the coordinator's
signature over the manifest (which names that SHA-256) are checked before any byte of the segment
is parsed; the predicted memory is checked against the budget before loading; the resident
memory actually added is measured after loading and warm-up and checked again.

Resident memory is measured with the C heap trimmed before and after (see
:mod:`edge_agent.runtime.engine`), so the report counts what the segment keeps, not heap that ORT
freed while loading. The transient peak while the session was built (the parsed protobuf next
to ORT's copy of the weights) is logged next to it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from edge_agent.config import RuntimeConfig
from edge_agent.errors import (
    BudgetError,
    DeployError,
    InputMismatchError,
    IntegrityError,
    SegmentLoadError,
    SignatureError,
    WrongTargetError,
)
from edge_agent.protobuf.limits import check_declared_sizes
from edge_agent.runtime.checks import Array, InputSpec, check_tensors
from edge_agent.runtime.engine import (
    SegmentSession,
    peak_resident_bytes,
    release_freed_heap,
    reset_peak_resident,
    resident_bytes,
)
from edge_agent.runtime.fixed_costs import FixedCostProbe, mean_costs
from edge_agent.runtime.sessions import SessionTable
from edge_agent.trust.identity import Identity, verify_signature
from protocols.deploy import (
    DeployManifest,
    DeployReport,
    DeployRequest,
    FixedCosts,
    signing_bytes,
)
from protocols.errors import FrameError
from protocols.frames import decode_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deployed:
    """A loaded segment with its signed manifest and what was measured at load."""

    manifest: DeployManifest
    session: SegmentSession
    report: DeployReport
    sessions: SessionTable | None = None
    """Per-session state (a decoder's KV cache), when the segment keeps any."""
    batchable: bool = False
    """Queued requests may run together (see :mod:`edge_agent.runtime.batching`)."""
    batch_symbol: str | None = None
    """The name of the shared first axis requests are stacked along, when batchable."""

    @property
    def frame_inputs(self) -> tuple[InputSpec, ...]:
        """Declared inputs that arrive in frames (state inputs are fed from ``sessions``)."""
        if self.sessions is None:
            return self.session.inputs
        pasts = self.sessions.pasts
        return tuple(spec for spec in self.session.inputs if spec.name not in pasts)

    @property
    def passthrough(self) -> tuple[str, ...]:
        """Forwarded names this segment does not compute: they must arrive in the frame."""
        produced = set(self.session.outputs)
        return tuple(name for name in self.manifest.forward if name not in produced)


class SegmentStore:
    """The segments this agent holds, by plan version; deploys are serialised by a lock."""

    def __init__(
        self, identity: Identity, budget_bytes: int, runtime: RuntimeConfig, segment_dir: Path
    ) -> None:
        self.identity = identity
        self._dir = segment_dir
        self._budget = budget_bytes
        self._runtime = runtime
        self._lock = threading.Lock()
        self._segments: dict[int, Deployed] = {}
        # built and run once here, not at the first deploy, so that the benchmark sessions and
        # their arenas are part of the baseline resident memory, not of a segment's or of serving
        self._costs = FixedCostProbe(runtime)
        self._costs.measure()

    def get(self, plan_version: int) -> Deployed | None:
        """The segment of a plan version, if loaded."""
        return self._segments.get(plan_version)

    def all(self) -> list[Deployed]:
        """Every loaded segment, oldest plan version first."""
        return [self._segments[v] for v in sorted(self._segments)]

    def committed_bytes(self) -> int:
        """Sum of the predicted memory of the loaded segments."""
        return sum(d.manifest.segment.predicted_memory_bytes for d in self._segments.values())

    def deploy(
        self, request: DeployRequest, segment: bytes | memoryview, warmup: bytes | memoryview = b""
    ) -> Deployed:
        """Verify, load and warm up a segment (blocking; run it in a worker thread)."""
        manifest = request.manifest
        entry = manifest.segment
        digest = hashlib.sha256(segment).hexdigest()
        if digest != entry.sha256:
            raise IntegrityError(
                f"segment bytes hash to {digest}, the manifest says {entry.sha256}"
            )
        warmup_digest = hashlib.sha256(warmup).hexdigest() if len(warmup) else None
        if warmup_digest != manifest.warmup_sha256:
            raise IntegrityError("the warm-up frame does not match the manifest's warmup_sha256")
        try:
            signature = bytes.fromhex(request.signature_hex)
        except ValueError as exc:
            raise SignatureError("the signature is not hex") from exc
        verify_signature(
            self.identity.ca_public_key,
            request.signature_algorithm,
            signature,
            signing_bytes(manifest),
        )
        if entry.device != self.identity.name:
            raise WrongTargetError(
                f"segment is for {entry.device!r}, this is {self.identity.name!r}"
            )
        with self._lock:
            if manifest.plan_version in self._segments:
                raise WrongTargetError(f"plan version {manifest.plan_version} is already loaded")
            free = self._budget - self.committed_bytes()
            if entry.predicted_memory_bytes > free:
                raise BudgetError(
                    f"segment needs {entry.predicted_memory_bytes} bytes (predicted), "
                    f"{free} of the {self._budget}-byte budget are free"
                )
            check_declared_sizes(segment, free, manifest.warmup_shapes)
            path = self._store_file(entry.sha256, segment)
            costs_before = self._fixed_costs()
            release_freed_heap()  # else freed heap from earlier work hides what loading adds
            before = resident_bytes()
            peak_known = reset_peak_resident()
            try:
                session = SegmentSession.load(path, self._runtime)
                table = _session_table(manifest, session)
                feeds = _warmup_feeds(session, warmup) if len(warmup) else None
                first, median = session.warm_up(
                    feeds,
                    manifest.warmup_shapes,
                    self._runtime.warmup_runs,
                    self._runtime.intra_op_threads,
                )
                measured = resident_bytes() - before
                peak = peak_resident_bytes() if peak_known else None
                if measured > free:
                    raise BudgetError(
                        f"segment added {measured} resident bytes after load and warm-up, "
                        f"over the {free} bytes free of the budget"
                    )
            except DeployError:
                self._drop_file(entry.sha256)
                raise
            costs = mean_costs(costs_before, self._fixed_costs())
            report = DeployReport(
                device=self.identity.name,
                plan_version=manifest.plan_version,
                segment_sha256=entry.sha256,
                predicted_memory_bytes=entry.predicted_memory_bytes,
                measured_memory_bytes=measured,
                predicted_compute_s=entry.predicted_compute_s,
                load_s=session.load_s,
                warmup_first_s=first,
                warmup_s=median,
                costs=costs,
            )
            axis = session.batch_axis() if table is None else None
            deployed = Deployed(manifest, session, report, table, axis is not None, axis)
            self._segments[manifest.plan_version] = deployed
        log.info(
            "loaded segment %d of plan %d: %d bytes resident (predicted %d; %s while loading), "
            "stage %.2f ms (predicted %.2f ms)",
            entry.index,
            manifest.plan_version,
            measured,
            entry.predicted_memory_bytes,
            "peak unknown" if peak is None else f"peak +{peak - before} bytes",
            median * 1e3,
            entry.predicted_compute_s * 1e3,
        )
        return deployed

    def unload(self, plan_version: int) -> bool:
        """Drop a plan version's segment; False when none was loaded."""
        with self._lock:
            dropped = self._segments.pop(plan_version, None)
            if dropped is not None:
                if dropped.sessions is not None:
                    dropped.sessions.clear()
                self._drop_file(dropped.manifest.segment.sha256)
            return dropped is not None

    def _fixed_costs(self) -> FixedCosts:
        """The operator, call and selection costs now (on the benchmark sessions built with
        the store, which are part of the baseline resident memory)."""
        return self._costs.measure()

    def _store_file(self, sha256: str, segment: bytes | memoryview) -> Path:
        """Write verified segment bytes to the state dir (ORT loads them from there)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"{sha256}.onnx"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as out:
                out.write(segment)
            tmp.replace(path)
        return path

    def _drop_file(self, sha256: str) -> None:
        if all(d.manifest.segment.sha256 != sha256 for d in self._segments.values()):
            (self._dir / f"{sha256}.onnx").unlink(missing_ok=True)


def _session_table(manifest: DeployManifest, session: SegmentSession) -> SessionTable | None:
    pairs = manifest.segment.state
    if not pairs:
        return None
    if manifest.sessions is None:  # the manifest's validator already refuses this
        raise SegmentLoadError("a segment with state needs session limits")
    declared = {spec.name for spec in session.inputs}
    missing = [p.past for p in pairs if p.past not in declared]
    missing += [p.present for p in pairs if p.present not in session.outputs]
    if missing:
        raise SegmentLoadError(f"state tensors {missing} are not inputs/outputs of the segment")
    return SessionTable(pairs, manifest.sessions, session.inputs)


def _warmup_feeds(session: SegmentSession, warmup: bytes | memoryview) -> dict[str, Array]:
    """The warm-up frame's tensors, checked like any request (only after its hash matched)."""
    try:
        frame = decode_frame(bytes(warmup))
        feeds, _ = check_tensors(session.inputs, frame.tensors, [])
    except (FrameError, InputMismatchError) as exc:
        raise SegmentLoadError(f"the warm-up frame does not fit the segment: {exc}") from exc
    return feeds
