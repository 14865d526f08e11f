"""The ``fedshard.problem/1`` cost model, one stage at a time: the reference semantics.

Everything here follows the docstring of :mod:`protocols.problem` literally, in plain Python.
The dynamic programme in :mod:`partitioner.planning.engine` performs the very same floating-point
operations in the very same order, so the value it optimises equals, bit for bit, what
:func:`evaluate` reports for the plan it returns:

- a stage's compute is the sum of its units' seconds (``compute_s[type]``, or the roofline time
  of a ``/2`` unit in a stage reading what the stage's units read together, both from
  :meth:`~protocols.problem.PlanningProblem.unit_seconds`), then
  the type's ``call_us`` (:meth:`~protocols.problem.PlanningProblem.call_seconds`), added
  left to right from 0;
- a transfer is ``float(out_bytes) * 8.0 / (bandwidth_mbps * 1e6) + latency_ms / 1e3``;
- latency is accumulated in chain order from 0: the in-transfer from the requester (if one is
  modelled), compute of stage 1, its transfer, compute of stage 2, ..., compute of the last stage,
  the out-transfer to the requester (if one is modelled);
- the bottleneck is the largest ``max(compute, transfer)`` over the stages and the in-transfer
  (the last stage's transfer is its out-transfer, 0 without a requester).
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols.links import Requester
from protocols.plan import Objective, Plan, Stage
from protocols.problem import PlanningProblem, ProblemDevice

Arrangement = Sequence[tuple[str, int, int]]
"""Stages in chain order as ``(device name, start, end)`` with half-open unit ranges."""


def link_between(
    problem: PlanningProblem, a: ProblemDevice, b: ProblemDevice
) -> tuple[float, float]:
    """``(bandwidth_mbps, latency_ms)`` of the link from ``a`` to ``b``.

    The ``links`` entry for the pair if there is one (links are undirected), otherwise the
    smaller of the two devices' bandwidths with zero latency.
    """
    for link in problem.links:
        if {link.a, link.b} == {a.name, b.name}:
            return link.bandwidth_mbps, link.latency_ms
    return min(a.bandwidth_mbps, b.bandwidth_mbps), 0.0


def requester_link(requester: Requester, device: ProblemDevice) -> tuple[float, float]:
    """``(bandwidth_mbps, latency_ms)`` of the link between ``requester`` and ``device``.

    The requester's ``links`` entry for the device if there is one, otherwise the device's own
    bandwidth with zero latency.
    """
    for link in requester.links:
        if link.device == device.name:
            return link.bandwidth_mbps, link.latency_ms
    return device.bandwidth_mbps, 0.0


def transfer_seconds(out_bytes: int, bandwidth_mbps: float, latency_ms: float) -> float:
    """Seconds to send ``out_bytes`` over a link (1 Mbps = 10^6 bits/s)."""
    return float(out_bytes) * 8.0 / (bandwidth_mbps * 1e6) + latency_ms / 1e3


def stage_compute(problem: PlanningProblem, device_type: str, start: int, end: int) -> float:
    """Compute seconds of units ``[start, end)`` on a device of ``device_type``: their
    seconds in a stage reading what they read together, added left to right, then the type's
    cost of one segment run."""
    stage_bytes = problem.stage_bytes(start, end)
    total = 0.0
    for index in range(start, end):
        total += problem.unit_seconds(index, device_type, stage_bytes)
    return total + problem.call_seconds(device_type)


def stage_memory(problem: PlanningProblem, start: int, end: int) -> int:
    """Bytes a device needs to hold units ``[start, end)`` as one stage."""
    units = problem.units[start:end]
    weights = sum(unit.weight_bytes for unit in units)
    shared = sum(
        weight.bytes
        for weight in problem.shared_weights
        if any(start <= index < end for index in weight.units)
    )
    workspace = max(unit.workspace_bytes for unit in units)
    in_bytes = problem.input_bytes if start == 0 else problem.units[start - 1].out_bytes
    buffers = (in_bytes + units[-1].out_bytes) * (1 + problem.queue_depth)
    return weights + shared + workspace + buffers


def check_arrangement(problem: PlanningProblem, stages: Arrangement) -> None:
    """Raise :class:`ValueError` unless ``stages`` cover the chain once, in order, on distinct
    known devices, each with at least one unit."""
    if not stages:
        raise ValueError("an arrangement needs at least one stage")
    known = {device.name for device in problem.devices}
    seen: set[str] = set()
    position = 0
    for device, start, end in stages:
        if device not in known:
            raise ValueError(f"unknown device {device!r}")
        if device in seen:
            raise ValueError(f"device {device!r} holds more than one stage")
        seen.add(device)
        if start != position or end <= start:
            raise ValueError(
                f"stage [{start}, {end}) on {device!r} does not continue at {position}"
            )
        position = end
    if position != len(problem.units):
        raise ValueError(f"the stages end at unit {position}, not {len(problem.units)}")


def evaluate(problem: PlanningProblem, objective: Objective, stages: Arrangement) -> Plan:
    """Score an arrangement exactly under the ``fedshard.problem/1`` semantics.

    Memory is reported per stage but not enforced; see :func:`memory_overflows`.
    Raises :class:`ValueError` if the arrangement is not a valid chain (see
    :func:`check_arrangement`).
    """
    check_arrangement(problem, stages)
    by_name = {device.name: device for device in problem.devices}
    incoming = _requester_transfer(problem, by_name[stages[0][0]], problem.input_bytes)
    result: list[Stage] = []
    latency = 0.0
    bottleneck = 0.0
    if incoming is not None:
        latency += incoming
        bottleneck = max(bottleneck, incoming)
    for index, (name, start, end) in enumerate(stages):
        device = by_name[name]
        compute = stage_compute(problem, device.type, start, end)
        out_bytes = problem.units[end - 1].out_bytes
        sent: float | None
        if index + 1 < len(stages):
            bandwidth, link_latency = link_between(problem, device, by_name[stages[index + 1][0]])
            sent = transfer_seconds(out_bytes, bandwidth, link_latency)
        else:
            sent = _requester_transfer(problem, device, out_bytes)
        latency += compute
        if sent is not None:
            latency += sent
        transfer = 0.0 if sent is None else sent
        bottleneck = max(bottleneck, compute, transfer)
        memory = stage_memory(problem, start, end)
        result.append(
            Stage(
                device=name,
                start=start,
                end=end,
                compute_s=compute,
                transfer_s=transfer,
                memory_bytes=memory,
            )
        )
    return Plan(
        objective=objective,
        bottleneck_s=bottleneck,
        latency_s=latency,
        input_transfer_s=0.0 if incoming is None else incoming,
        stages=result,
    )


def _requester_transfer(problem: PlanningProblem, device: ProblemDevice, size: int) -> float | None:
    """Seconds to move ``size`` bytes between the requester and ``device`` (``None``: no
    requester is modelled)."""
    if problem.requester is None:
        return None
    return transfer_seconds(size, *requester_link(problem.requester, device))


def memory_overflows(problem: PlanningProblem, plan: Plan) -> list[tuple[str, int]]:
    """``(device, bytes over its memory)`` for every stage of ``plan`` that does not fit."""
    by_name = {device.name: device for device in problem.devices}
    overflows = []
    for stage in plan.stages:
        over = stage.memory_bytes - by_name[stage.device].memory_bytes
        if over > 0:
            overflows.append((stage.device, over))
    return overflows


def format_bytes(size: int) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB`` (negative keeps its sign)."""
    if abs(size) < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"
