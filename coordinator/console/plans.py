"""The plan as the console shows it: each stage's device, units, memory and time, and what-ifs.

:func:`deployed_view` puts a deployed version's plan (its manifest) next to what the agents
measured (resident memory after loading, warm-up stage time) and the devices' budgets.
:func:`what_if` re-plans a deployed model with the partitioner's pure planner on changed
budgets or without some devices, without deploying anything. Analysing a model's graph takes
about a second for MiniLM, so :class:`AnalysisCache` keeps the last few analyses.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from coordinator.deploy.plan import DEFAULT_BANDWIDTH_MBPS
from coordinator.deploy.store import VersionRecord, segment_dir
from coordinator.errors import DeployError
from protocols.devices import DeviceList, DeviceSpec
from protocols.errors import SchemaError
from protocols.links import Link as DeviceLink
from protocols.links import Requester, RequesterLink
from protocols.manifest import MANIFEST_FILE, Manifest
from protocols.plan import Objective, Plan
from protocols.roofs import slowed_roofs

if TYPE_CHECKING:
    from partitioner.cutting.inputs import Analysis


class StageView(BaseModel):
    """One stage of a plan, in chain order."""

    model_config = ConfigDict(frozen=True)

    index: int
    device: str
    unit_start: int | None
    unit_end: int | None
    """Half-open range of planning units the stage holds (None if unknown)."""
    first_unit: str | None = None
    last_unit: str | None = None
    budget_bytes: int | None
    """The memory the device may use (its announced budget, or the what-if's)."""
    predicted_memory_bytes: int
    state_bytes: int = 0
    """Of ``predicted_memory_bytes``, the sessions' reserved KV cache (allocated per session,
    so not in the memory measured after loading)."""
    measured_memory_bytes: int | None = None
    """Resident memory the agent measured after loading (deployed versions only)."""
    predicted_compute_s: float
    """One request, or for a decoder one decode step (what throughput is planned on)."""
    predicted_prefill_s: float | None = None
    """Decoders: the stage's predicted time to prefill a prompt, shown next to the step."""
    predicted_transfer_s: float | None = None
    measured_compute_s: float | None = None
    """The agent's warm-up stage time (deployed versions only)."""
    bottleneck: bool = False


class PlanView(BaseModel):
    """A plan with its stages; ``bottleneck_basis`` says which times chose the bottleneck."""

    model_config = ConfigDict(frozen=True)

    model_id: str
    plan_version: int | None
    version: int | None = None
    """The model's version number (``MODEL vN``); None for a what-if."""
    objective: Objective
    total_units: int | None
    predicted_bottleneck_s: float | None
    predicted_latency_s: float | None
    bottleneck_index: int
    bottleneck_basis: Literal["measured", "predicted"]
    stages: list[StageView]


class AnalysisCache:
    """The partitioner's analysis of model files, by path, size and modification time."""

    def __init__(self, size: int = 2) -> None:
        self._size = size
        self._entries: OrderedDict[tuple[str, int, int], Analysis] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path) -> Analysis:
        """The analysis of the ONNX file at ``path``; raises DeployError if it cannot be read."""
        from partitioner.analysis.modelio import load_model
        from partitioner.cutting.split import analyse
        from partitioner.errors import PartitionerError

        try:
            stat = path.stat()
        except OSError as exc:
            raise DeployError(f"the model file {path} is gone: {exc.strerror}") from exc
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        with self._lock:  # one analysis at a time: each holds the whole graph in memory
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            try:
                analysis = analyse(load_model(path))
            except (PartitionerError, OSError) as exc:
                raise DeployError(f"cannot analyse {path.name}: {exc}") from exc
            self._entries[key] = analysis
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
            return analysis


def read_manifest(state_dir: Path | None, version: VersionRecord) -> Manifest | None:
    """The manifest the deployer wrote for ``version`` (None if it is not there)."""
    if state_dir is None:
        return None
    path = segment_dir(state_dir, version.model_id, version.plan_version)
    try:
        return Manifest.from_json((path / MANIFEST_FILE).read_bytes())
    except (OSError, SchemaError):
        return None


def _unit_name(names: Sequence[str] | None, k: int) -> str | None:
    return names[k] if names is not None and 0 <= k < len(names) else None


def deployed_view(
    version: VersionRecord,
    manifest: Manifest | None,
    budgets: Mapping[str, int],
    unit_names: Sequence[str] | None = None,
) -> PlanView:
    """A deployed version's plan next to what its agents measured; the bottleneck is the stage
    with the longest measured warm-up time."""
    entries = {s.index: s for s in manifest.segments} if manifest is not None else {}
    stages = []
    for p in version.segments:
        entry = entries.get(p.index)
        start, end = entry.units if entry is not None else (None, None)
        stages.append(
            StageView(
                index=p.index,
                device=p.device,
                unit_start=start,
                unit_end=end,
                first_unit=_unit_name(unit_names, start) if start is not None else None,
                last_unit=_unit_name(unit_names, end - 1) if end is not None else None,
                budget_bytes=budgets.get(p.device),
                predicted_memory_bytes=p.predicted_memory_bytes,
                state_bytes=p.state_bytes,
                measured_memory_bytes=p.measured_memory_bytes,
                predicted_compute_s=p.predicted_compute_s,
                predicted_prefill_s=entry.predicted_prefill_s if entry is not None else None,
                measured_compute_s=p.warmup_s,
            )
        )
    worst = max(range(len(stages)), key=lambda k: stages[k].measured_compute_s or 0.0)
    ends = [s.unit_end for s in stages if s.unit_end is not None]
    return PlanView(
        model_id=version.model_id,
        plan_version=version.plan_version,
        version=version.version,
        objective=version.objective,
        total_units=max(ends) if ends else None,
        predicted_bottleneck_s=manifest.bottleneck_s if manifest is not None else None,
        predicted_latency_s=manifest.latency_s if manifest is not None else None,
        bottleneck_index=worst,
        bottleneck_basis="measured",
        stages=[s.model_copy(update={"bottleneck": s.index == worst}) for s in stages],
    )


def plan_view(
    model_id: str, plan: Plan, names: Sequence[str], budgets: Mapping[str, int]
) -> PlanView:
    """A planner's answer as the console shows it; the bottleneck is the stage with the largest
    predicted max(compute, transfer), the first stage's counting the input's hand-off to it."""
    times = [max(s.compute_s, s.transfer_s) for s in plan.stages]
    times[0] = max(times[0], plan.input_transfer_s)
    worst = max(range(len(times)), key=times.__getitem__)
    stages = [
        StageView(
            index=k,
            device=s.device,
            unit_start=s.start,
            unit_end=s.end,
            first_unit=_unit_name(names, s.start),
            last_unit=_unit_name(names, s.end - 1),
            budget_bytes=budgets.get(s.device),
            predicted_memory_bytes=s.memory_bytes,
            predicted_compute_s=s.compute_s,
            predicted_transfer_s=s.transfer_s,
            bottleneck=k == worst,
        )
        for k, s in enumerate(plan.stages)
    ]
    return PlanView(
        model_id=model_id,
        plan_version=None,
        objective=plan.objective,
        total_units=len(names),
        predicted_bottleneck_s=plan.bottleneck_s,
        predicted_latency_s=plan.latency_s,
        bottleneck_index=worst,
        bottleneck_basis="predicted",
        stages=stages,
    )


def what_if_devices(
    profiles: Mapping[str, tuple[int, float]],
    links: Sequence[DeviceLink],
    budgets: Mapping[str, int],
    drop: Sequence[str],
    requester: Sequence[RequesterLink] = (),
    roofs: Mapping[str, Mapping[str, float | None]] | None = None,
    slowdown: Mapping[str, float] | None = None,
) -> DeviceList:
    """The planner's devices: ``profiles`` maps each usable device to its announced (memory
    budget, GFLOP/s); ``budgets`` overrides memory, ``drop`` leaves devices out; ``requester``:
    the coordinator's measured links to the devices, counted as a deploy counts them.

    ``roofs``: each device's other announced roofs (memory and cache bandwidth, operator, call
    and TopK costs), so a what-if is priced by the roofline as a deploy is; ``slowdown``:
    devices measured that many times slower than planned, every roof of theirs scaled by it
    (the re-plan on the new measurements that the slowness suggestion offers)."""
    slow = dict(slowdown or {})
    unknown = sorted((set(budgets) | set(drop) | set(slow)) - set(profiles))
    if unknown:
        raise DeployError(f"these devices are not paired and online: {', '.join(unknown)}")
    names = [n for n in profiles if n not in set(drop)]
    if not names:
        raise DeployError("every device was dropped: nothing is left to plan on")
    if any(factor <= 0 for factor in slow.values()):
        raise DeployError("a slowdown must be positive")
    specs = [
        _slowed(
            DeviceSpec(
                name=n,
                memory_bytes=budgets.get(n, profiles[n][0]),
                gflops=profiles[n][1],
                bandwidth_mbps=DEFAULT_BANDWIDTH_MBPS,
                **dict((roofs or {}).get(n, {})),
            ),
            slow.get(n, 1.0),
        )
        for n in names
    ]
    kept = [link for link in links if link.a in names and link.b in names]
    to_devices = [link for link in requester if link.device in names]
    return DeviceList(devices=specs, links=kept, requester=Requester(links=to_devices))


def _slowed(spec: DeviceSpec, factor: float) -> DeviceSpec:
    """``spec`` with every roof scaled so any work takes ``factor`` times as long."""
    if factor == 1.0:
        return spec
    return spec.model_copy(update=slowed_roofs(spec, factor, factor, factor))


def what_if(analysis: Analysis, devices: DeviceList, objective: Objective, name: str) -> Plan:
    """Plan ``analysis`` onto ``devices`` exactly as a deploy would, without deploying.

    Raises DeployError when no arrangement fits (with the shortfall in plain words).
    """
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import choose_plan, planning_problem
    from partitioner.errors import InfeasiblePlanError, PartitionerError

    opts = SplitOptions(objective)
    try:
        problem = planning_problem(analysis, devices, opts, name)
        return choose_plan(problem, opts, analysis)
    except InfeasiblePlanError as exc:
        raise DeployError(f"no plan fits these devices: {exc}") from exc
    except (PartitionerError, SchemaError) as exc:
        raise DeployError(f"cannot plan with these devices: {exc}") from exc
