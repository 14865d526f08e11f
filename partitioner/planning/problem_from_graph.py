"""Turn graph units and a ``DEVICES.json`` into a ``fedshard.problem/1`` planning problem."""

from __future__ import annotations

import math
from collections.abc import Sequence

from partitioner.analysis.runtime_memory import GRAPH_ONLY, RuntimeMemory
from partitioner.analysis.units import UnitPlan
from partitioner.errors import GraphError
from protocols.constants import DEFAULT_QUEUE_DEPTH, ROOFLINE_PROBLEM_FORMAT
from protocols.devices import DeviceList, DeviceSpec
from protocols.problem import PlanningProblem, Roofs, Work, roofline_s
from protocols.roofs import roof_values


def device_type(name: str) -> str:
    """The device type used for a ``DEVICES.json`` device: every device is its own type."""
    return name


def build_problem(
    units: UnitPlan,
    devices: DeviceList,
    *,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    name: str = "",
    compute_shares: Sequence[float] | None = None,
    runtime: RuntimeMemory = GRAPH_ONLY,
    state_bytes: Sequence[int] | None = None,
    work: Sequence[Work] | None = None,
    prefill: Sequence[Work] | None = None,
    phase: str = "",
) -> PlanningProblem:
    """The planning problem for placing ``units`` on ``devices``.

    A unit's compute on a device is its FLOPs over the device's GFLOP/s; shared initializers
    (tied embeddings) are counted in each stage that reads them; links and the requester (the
    links that bring inputs in and take results back) are copied.

    ``compute_shares`` (one per unit, summing to 1, e.g. measured by
    :mod:`partitioner.cutting.calibrate`) redistributes the compute: a unit's compute becomes the
    whole model's FLOPs over the device's GFLOP/s times its share, so each device keeps its rated
    speed while the units' relative costs are the measured ones.

    ``runtime`` says what the agent's ONNX Runtime keeps resident beyond weights and queued
    frames (see :mod:`partitioner.analysis.runtime_memory`); a unit's ``workspace_bytes`` becomes
    ``runtime.stage_bytes`` of its live set, so each stage is charged the fixed per-session
    overhead once plus the arena for its largest unit. The default, :data:`GRAPH_ONLY`, charges
    the graph's live set alone.

    ``state_bytes`` (one per unit) is per-session state a unit keeps resident, a decoder's KV
    cache at its planned sessions and context: it is added to the unit's ``weight_bytes``.

    ``work`` (one per unit, from :mod:`partitioner.analysis.roofline`): when given and some device
    has a memory roof, the problem is a ``fedshard.problem/2`` priced by the roofline: each unit
    carries its work (and its ``prefill`` work, shown next to the plan) and each device its
    roofs, and ``compute_s`` is left to the roofline (``phase`` names what ``work``
    describes). With ``compute_shares`` as well, each device's roofline time for the whole
    model is kept and distributed over the units by the measured shares: ``compute_s`` is
    given, so what the roofline gets wrong about one kind of unit against another (operator
    overheads, caches) comes from the measurement, and what it says about the device's
    speed from its roofs.

    Raises :class:`~protocols.errors.SchemaError` if the devices do not make a valid problem
    (e.g. a link given twice), :class:`~partitioner.errors.GraphError` if ``compute_shares``
    does not have one share per unit.
    """
    charged = _unit_work(units, compute_shares)
    state = list(state_bytes) if state_bytes is not None else [0] * len(units.units)
    if len(state) != len(units.units):
        raise GraphError(f"{len(state)} state sizes for {len(units.units)} units")
    roofline = work is not None and any(d.memory_gbps is not None for d in devices.devices)
    document: dict[str, object] = {
        "name": name,
        "input_bytes": units.input_bytes,
        "queue_depth": queue_depth,
        "units": [
            {
                "name": u.name,
                "weight_bytes": u.weight_bytes + kv,
                "out_bytes": u.out_bytes,
                "workspace_bytes": runtime.stage_bytes(u.workspace_bytes),
                "compute_s": {
                    device_type(d.name): flops / (d.gflops * 1e9) for d in devices.devices
                },
            }
            for u, flops, kv in zip(units.units, charged, state, strict=True)
        ],
        "devices": [
            {
                "name": d.name,
                "type": device_type(d.name),
                "memory_bytes": d.memory_bytes,
                "bandwidth_mbps": d.bandwidth_mbps,
            }
            | (_roofs(d) if roofline else {})
            for d in devices.devices
        ],
        "links": [link.model_dump() for link in devices.links],
        "shared_weights": [
            {"name": s.name, "bytes": s.nbytes, "units": list(s.units)} for s in units.shared
        ],
    }
    if devices.requester is not None:
        document["requester"] = devices.requester.model_dump()
    if roofline:
        assert work is not None
        _price_by_roofline(document, work, prefill, phase)
        if compute_shares is not None:
            _distribute(document, devices, work, compute_shares)
    return PlanningProblem.from_obj(document)


def _distribute(
    document: dict[str, object],
    devices: DeviceList,
    work: Sequence[Work],
    shares: Sequence[float],
) -> None:
    """Give every unit ``compute_s``: its share of each device's roofline time for the model."""
    units = document["units"]
    assert isinstance(units, list)
    for device in devices.devices:
        roofs = Roofs.model_validate(_roofs(device))
        model_bytes = sum(w.bytes_read for w in work)
        total = math.fsum(roofline_s(w, roofs, model_bytes) for w in work)
        for unit, share in zip(units, shares, strict=True):
            unit["compute_s"][device_type(device.name)] = total * share


def _roofs(device: DeviceSpec) -> dict[str, object]:
    return {"gflops": device.gflops, **roof_values(device)}


def _price_by_roofline(
    document: dict[str, object],
    work: Sequence[Work],
    prefill: Sequence[Work] | None,
    phase: str,
) -> None:
    """Turn ``document`` into a ``/2`` problem whose units are priced by their work."""
    units = document["units"]
    assert isinstance(units, list)
    if len(work) != len(units) or (prefill is not None and len(prefill) != len(units)):
        raise GraphError(f"work for {len(work)} units, the chain has {len(units)}")
    document["format"] = ROOFLINE_PROBLEM_FORMAT
    document["phase"] = phase
    for k, unit in enumerate(units):
        unit["compute_s"] = {}
        unit["work"] = work[k].model_dump()
        if prefill is not None:
            unit["prefill"] = prefill[k].model_dump()


def _unit_work(units: UnitPlan, shares: Sequence[float] | None) -> list[float]:
    """FLOPs to charge each unit: its own, or its share of the model's."""
    if shares is None:
        return [float(u.flops) for u in units.units]
    if len(shares) != len(units.units):
        raise GraphError(f"{len(shares)} compute shares for {len(units.units)} units")
    total = sum(u.flops for u in units.units)
    return [total * share for share in shares]
