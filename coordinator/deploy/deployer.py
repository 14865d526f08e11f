"""Plan, split, sign, push, health-check and switch: one deployment, end to end.

A new version is loaded and warmed beside the live one (agents hold one segment per plan
version), checked through the data plane against a local run of the same segments, and only
then made active; the version it replaces stays loaded as *previous* for a one-step rollback,
and older ones are unloaded. A deploy that no plan fits beside the versions kept for rollback
retires and unloads them and plans again: they give way to what the operator asks for. A
failure at any step unloads what was pushed and leaves the live version untouched.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from coordinator.deploy.cutting import (
    Arrays,
    DeployCommand,
    SplitOutcome,
    refuse_draft_only,
    split_and_run,
    version_outcome,
)
from coordinator.deploy.model_files import ModelFormat, model_format
from coordinator.deploy.peak_memory import peak_rss_bytes
from coordinator.deploy.plan import LiveDevice, deploy_bodies, device_list, max_abs_diff
from coordinator.deploy.pushing import push_per_host
from coordinator.deploy.stage_timing import (
    StageTiming,
    stage_times,
)
from coordinator.deploy.store import (
    DeploymentStore,
    Placement,
    VersionRecord,
    model_kind,
    now,
    segment_dir,
    version_label,
)
from coordinator.errors import (
    AgentError,
    AgentRefusedError,
    CoordinatorError,
    DeployError,
    NoFitError,
    NoRoomError,
)
from coordinator.fleet.registry import DeviceRecord
from coordinator.transport.agent_client import AgentAddress, AgentClient
from protocols.deploy import DeployReport, Hop, ShapeLimits
from protocols.errors import ControlErrorCode
from protocols.gguf_card import GgufCard
from protocols.links import Link as DeviceLink
from protocols.links import RequesterLink
from protocols.manifest import Manifest
from protocols.plan import Objective

log = logging.getLogger(__name__)
HEALTH_TOLERANCE = 1e-4

HealthCheck = Callable[[list[Hop], int, Arrays], Arrays]
"""Send inputs into a chain for a plan version; the outputs."""


class Deployer:
    """Deploys and rolls back; one deployment at a time."""

    def __init__(
        self,
        state_dir: Path,
        store: DeploymentStore,
        agents: AgentClient,
        trusted: Callable[[], list[DeviceRecord]],
        links: Callable[[], list[DeviceLink]],
        sign: Callable[[bytes], bytes],
        health: HealthCheck,
        retired: Callable[[int], None] = lambda plan_version: None,
        requester_links: Callable[[], list[RequesterLink]] | None = None,
        segment_cache: Path | None = None,
        timing: StageTiming | None = None,
    ) -> None:
        self._state_dir = state_dir
        self._store = store
        self._agents = agents
        self._trusted = trusted
        self._links = links
        self._sign = sign
        self._health = health
        self._retired = retired
        self._requester_links = requester_links
        self._segment_cache = segment_cache
        self._timing = timing
        self._lock = threading.Lock()
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()

    def deploy(self, command: DeployCommand) -> VersionRecord:
        """The whole deployment; raises DeployError (the live version keeps serving)."""
        if not command.model_path.is_file():
            raise DeployError(f"no model file at {command.model_path}")
        if check_model_file(command.model_path) is ModelFormat.ONNX:
            refuse_draft_only(command.model_path)
        with self._lock:
            plan_version = self._store.reserve_plan_version()
            out = self.segment_dir(command.model_id, plan_version)
            try:
                raw, live, split = self._plan(command, out)
            except NoFitError:
                if not self._unload_rollback_copies():
                    raise
                raw, live, split = self._plan(command, out)
            version = self._install(command, plan_version, split, live)
            if self._timing is not None:
                ranges = [s.units for s in split.manifest.segments]
                stages = stage_times(version, split.unit_work, ranges, raw)
                self._timing.record(stages, {d.name: d.correction for d in live})
            return version

    def _plan(
        self, command: DeployCommand, out: Path
    ) -> tuple[list[LiveDevice], list[LiveDevice], SplitOutcome]:
        """The devices as they are, as priced (calibrated), and the model planned and cut on
        them into ``out``."""
        raw = self._live_devices()
        live = raw if self._timing is None else self._timing.apply(raw, command.model_id)
        links = self._links()
        requester = None if self._requester_links is None else self._requester_links()
        devices = device_list(live, links, command.memory_caps, command.strict_caps, requester)
        scales = None if self._timing is None else self._timing.unit_scales(command.model_id)
        if model_format(command.model_path) is ModelFormat.GGUF:
            # heavy: gguf (the builder room's reader) is not in the coordinator extra
            from coordinator.deploy.gguf_cut import gguf_split_and_run

            return raw, live, gguf_split_and_run(command, devices, out, scales)
        return raw, live, split_and_run(command, devices, out, self._segment_cache, scales)

    def _unload_rollback_copies(self) -> bool:
        """Retire and unload every model's previous version; whether there was any."""
        retired = self._store.retire_every_previous()
        for old in retired:
            log.warning(
                "unloading %s, kept for a rollback, to make room for a deploy", version_label(old)
            )
            self._retired(old.plan_version)
            self._unload([_placement_address(p) for p in old.segments], old.plan_version)
        return bool(retired)

    def replan(self, version: VersionRecord, trigger: str) -> VersionRecord:
        """Deploy ``version``'s model again, planned on the devices online now (failover).

        Same source, objective, operator caps (caps of devices that are away are kept for
        later but not applied) and tokenizer, so a text encoder is planned at its serving
        shapes again; raises DeployError when the devices cannot hold it.
        """
        command = DeployCommand(
            model_path=Path(version.source),
            model_id=version.model_id,
            objective=version.objective,
            memory_caps=version.memory_caps,
            tokenizer_dir=self._store.model(version.model_id).tokenizer_dir,
            trigger=trigger,
            strict_caps=False,
            weights=version.card.weights if version.card is not None else "keep",
        )
        return self.deploy(command)

    def release(self, version: VersionRecord, lost: Collection[str]) -> None:
        """Unload ``version``, which lost the devices ``lost`` and cannot serve, from the devices
        that still hold it; so too the model's previous version if it used one of them (it is
        retired: a rollback to it could not serve either). A failover's re-plan needs their
        memory: a model that fills its devices does not fit beside its own broken copy."""
        with self._lock:
            retired = self._store.retire_previous(version.model_id, using=lost)
        for broken in [version, *([retired] if retired is not None else [])]:
            holders = [_placement_address(p) for p in broken.segments if p.device not in lost]
            self._unload(holders, broken.plan_version)

    def segment_dir(self, model_id: str, plan_version: int) -> Path:
        """Where the manifest and segment files of a deployed version are kept
        (:func:`~coordinator.deploy.store.segment_dir`)."""
        return segment_dir(self._state_dir, model_id, plan_version)

    def deploy_version(
        self, model_id: str, version_dir: Path, samples: Arrays, objective: Objective
    ) -> VersionRecord:
        """Roll out an already-cut version (``manifest.json`` plus segment files, e.g. one that
        federated fine-tuning wrote) on the devices its manifest names, without re-planning:
        loaded beside the live version, health-checked on ``samples``, then switched to.

        When it cannot be placed as cut (:class:`NoRoomError`: a device is offline or has no
        room for a changed segment beside the live one) and the version carries its whole
        model (a merged LoRA run), the whole model is planned afresh on the devices' free
        memory, as a deploy is; every segment is then new. Any other failure (a health check,
        a signature) is raised as it is."""
        try:
            return self._deploy_cut(model_id, version_dir, samples, objective)
        except NoRoomError as exc:
            whole = version_dir / "model.onnx"
            if not whole.is_file():
                raise
            log.warning("%s did not roll out as cut (%s); planning it afresh", version_dir, exc)
            active = self._store.active(model_id)
            command = DeployCommand(
                model_path=whole,
                model_id=model_id,
                objective=objective,
                memory_caps=active.memory_caps,
                tokenizer_dir=self._store.model(model_id).tokenizer_dir,
                trigger=f"rollout of {version_dir.name}: re-planned ({exc})",
                strict_caps=False,
            )
            return self.deploy(command)

    def _deploy_cut(
        self, model_id: str, version_dir: Path, samples: Arrays, objective: Objective
    ) -> VersionRecord:
        with self._lock:
            live = self._live_devices()
            plan_version = self._store.reserve_plan_version()
            out = self.segment_dir(model_id, plan_version)
            shutil.copytree(version_dir, out)
            split = version_outcome(version_dir, out, samples)
            missing = sorted({s.device for s in split.manifest.segments} - {d.name for d in live})
            if missing:
                raise NoRoomError(f"devices of {version_dir.name} are not online: {missing}")
            split = replace(split, limits=self._kept_limits(model_id))
            # a version that carries its whole model (a merged LoRA run) re-plans from it
            whole = version_dir / "model.onnx"
            command = DeployCommand(whole if whole.is_file() else version_dir, model_id, objective)
            return self._install(command, plan_version, split, live)

    def _kept_limits(self, model_id: str) -> ShapeLimits | None:
        """A new version of a model (fine-tuned segments) keeps the live version's limits."""
        try:
            return self._store.active(model_id).limits
        except CoordinatorError:
            return None

    def _install(
        self,
        command: DeployCommand,
        plan_version: int,
        split: SplitOutcome,
        live: list[LiveDevice],
    ) -> VersionRecord:
        """Push, health-check and switch to ``split`` (the caller holds the lock)."""
        by_name = {d.name: d for d in live}
        chain = [
            Hop(
                device=s.device,
                host=by_name[s.device].host,
                data_port=by_name[s.device].data_port,
            )
            for s in split.manifest.segments
        ]
        bodies = deploy_bodies(
            split.manifest,
            chain,
            split.segment_dir,
            split.warmups,
            f"{command.model_id}@{plan_version}",
            plan_version,
            self._sign,
            split.limits,
        )
        addresses = [_address(by_name[s.device]) for s in split.manifest.segments]
        reports = self._push(addresses, bodies, plan_version)
        try:
            diff = self._check(chain, plan_version, split)
        except CoordinatorError:
            self._unload(addresses, plan_version)
            raise
        tokenizer_dir = command.tokenizer_dir
        if split.tokenizer_dir is not None:
            tokenizer_dir = str(split.tokenizer_dir)
        inputs = split.manifest.model.inputs
        version = VersionRecord(
            model_id=command.model_id,
            version=self._store.next_version(command.model_id),
            plan_version=plan_version,
            kind=model_kind(inputs, command.model_path, tokenizer_dir),
            state="active",
            created_at=now(),
            source=str(command.model_path),
            objective=command.objective,
            inputs=inputs,
            outputs=split.manifest.model.outputs,
            segments=_placements(split.manifest, by_name, reports),
            health_max_abs_diff=diff,
            memory_caps=dict(command.memory_caps),
            trigger=command.trigger,
            limits=split.limits,
            card=_with_deploy_peak(split),
        )
        retired = self._store.activate(version, tokenizer_dir)
        for old in retired:
            self._retired(old.plan_version)
            self._unload([_placement_address(p) for p in old.segments], old.plan_version)
        log.info("%s is live (plan version %d)", version_label(version), plan_version)
        return version

    def busy_devices(self) -> frozenset[str]:
        """Devices a segment is being pushed to (and loaded on) right now."""
        with self._busy_lock:
            return frozenset(self._busy)

    def rollback(self, model_id: str) -> VersionRecord:
        """Switch back to the previous version (still loaded on its agents)."""
        with self._lock:
            return self._store.rollback(model_id)

    def _live_devices(self) -> list[LiveDevice]:
        records = self._trusted()
        if not records:
            raise DeployError("no paired agent is online")
        with ThreadPoolExecutor(max_workers=len(records)) as pool:
            statuses = list(pool.map(lambda r: self._agents.status(_address_of(r)), records))
        return [
            LiveDevice(
                name=r.name,
                budget_bytes=s.memory_budget_bytes,
                committed_bytes=s.memory_committed_bytes,
                gflops=s.gflops,
                memory_gbps=s.memory_gbps,
                cache_bytes=s.cache_bytes or 0,
                cache_gbps=s.cache_gbps,
                op_us=s.op_us or 0.0,
                call_us=s.call_us or 0.0,
                topk_ns=s.topk_ns or 0.0,
                gemv_gflops=s.gemv_gflops,
                vector_gflops=s.vector_gflops,
                host=r.host,
                control_port=r.announcement.profile.control_port,
                data_port=r.announcement.profile.data_port,
            )
            for r, s in zip(records, statuses, strict=True)
        ]

    def _push(
        self,
        addresses: Sequence[AgentAddress],
        bodies: Sequence[Callable[[], bytes]],
        plan_version: int,
    ) -> list[DeployReport]:
        devices = {a.device for a in addresses}
        with self._busy_lock:
            self._busy |= devices
        try:
            outcomes = push_per_host(self._agents.deploy, addresses, bodies)
        finally:
            with self._busy_lock:
                self._busy -= devices
        refused = [o for o in outcomes if isinstance(o, Exception)]
        if refused:
            pushed = [
                a for a, o in zip(addresses, outcomes, strict=True) if isinstance(o, DeployReport)
            ]
            self._unload(pushed, plan_version)
            kind = NoRoomError if all(map(_over_budget, refused)) else DeployError
            errors = [
                f"{a.device}: {o}"
                for a, o in zip(addresses, outcomes, strict=True)
                if isinstance(o, Exception)
            ]
            raise kind("pushing segments failed: " + "; ".join(errors))
        return [o for o in outcomes if isinstance(o, DeployReport)]

    def _check(self, chain: list[Hop], plan_version: int, split: SplitOutcome) -> float:
        try:
            got = self._health(chain, plan_version, split.samples)
        except CoordinatorError as exc:
            raise DeployError(f"health check through the data plane failed: {exc}") from exc
        diff = max_abs_diff(got, split.expected)
        if diff > HEALTH_TOLERANCE:
            raise DeployError(f"health check: the chain differs from the model by {diff:.3g}")
        return diff

    def _unload(self, addresses: Sequence[AgentAddress], plan_version: int) -> None:
        for address in addresses:
            try:
                self._agents.unload(address, plan_version)
            except AgentError as exc:
                log.warning(
                    "could not unload plan %d from %s: %s", plan_version, address.device, exc
                )


def _with_deploy_peak(split: SplitOutcome) -> GgufCard | None:
    """A GGUF version's card with the peak resident memory since its build began (the build's
    measurement reset the high-water mark), so pushing and the health check count too."""
    card = split.card
    if card is None or card.build is None:
        return card
    peak = max(peak_rss_bytes(), card.build.peak_rss_bytes)
    build = card.build.model_copy(update={"deploy_peak_rss_bytes": peak})
    log.info(
        "deploy of %s: peak resident memory %.1f MB while building, pushing and checking "
        "(file %.1f MB, largest segment %.1f MB)",
        card.file,
        peak / 1e6,
        card.file_bytes / 1e6,
        card.build.largest_segment_bytes / 1e6,
    )
    return card.model_copy(update={"build": build})


def check_model_file(path: Path) -> ModelFormat:
    """The format of a model file a deploy names; refused before anything is planned or pushed
    when it is neither ONNX nor GGUF (:class:`~coordinator.errors.ModelFormatError`) or a GGUF
    the builder cannot serve (:class:`~coordinator.errors.UnsupportedModelError`)."""
    kind = model_format(path)
    if kind is ModelFormat.GGUF:
        # heavy: gguf (the builder room's reader) is not in the coordinator extra
        from coordinator.deploy.gguf_cut import header_of

        header_of(path)
    return kind


def _address_of(record: DeviceRecord) -> AgentAddress:
    return AgentAddress(record.name, record.host, record.announcement.profile.control_port)


def _hop(device: LiveDevice) -> Hop:
    return Hop(device=device.name, host=device.host, data_port=device.data_port)


def _address(device: LiveDevice) -> AgentAddress:
    return AgentAddress(device.name, device.host, device.control_port)


def _placement_address(placement: Placement) -> AgentAddress:
    return AgentAddress(placement.device, placement.host, placement.control_port)


def _placements(
    manifest: Manifest, by_name: Mapping[str, LiveDevice], reports: Sequence[DeployReport]
) -> list[Placement]:
    return [
        Placement(
            index=seg.index,
            device=seg.device,
            host=by_name[seg.device].host,
            control_port=by_name[seg.device].control_port,
            data_port=by_name[seg.device].data_port,
            sha256=seg.sha256,
            param_bytes=seg.param_bytes,
            predicted_memory_bytes=seg.predicted_memory_bytes,
            state_bytes=seg.state_bytes,
            predicted_compute_s=seg.predicted_compute_s,
            predicted_prefill_s=seg.predicted_prefill_s,
            measured_memory_bytes=report.measured_memory_bytes,
            warmup_s=report.warmup_s,
            load_s=report.load_s,
            costs=report.costs,
        )
        for seg, report in zip(manifest.segments, reports, strict=True)
    ]


def _over_budget(exc: BaseException) -> bool:
    """Whether an agent refused a segment for its memory budget."""
    return isinstance(exc, AgentRefusedError) and exc.error == ControlErrorCode.OVER_BUDGET
