"""``fedshard.problem/1``: a planning problem stated directly.

A model is a chain of *units*; devices each hold at most one contiguous stage of
units. The semantics (which the planner implements exactly) are:

- a stage's compute is the sum of its units' ``compute_s[device.type]``;
- every stage but the last sends its last unit's ``out_bytes`` to the next stage's
  device, taking ``out_bytes * 8 / (bandwidth_mbps * 1e6) + latency_ms / 1e3`` seconds,
  where the link is the ``links`` entry for the pair if any, otherwise the smaller of
  the two devices' ``bandwidth_mbps`` with zero latency;
- with a ``requester`` (the coordinator, where requests come from), the first stage first
  receives ``input_bytes`` from it (the *in-transfer*) and the last stage sends its last
  unit's ``out_bytes`` back to it (the *out-transfer*), each taking the same formula's time
  over the requester's ``links`` entry for that device if any, otherwise the device's own
  ``bandwidth_mbps`` with zero latency; without one (``None``) both are absent;
- latency is ``in-transfer + compute_1 + transfer_1 + ... + compute_K + out-transfer``,
  added in that order (without a requester: from ``compute_1`` to ``compute_K``);
- the bottleneck is the largest of the in-transfer, every stage's compute and transfer,
  and the out-transfer;
- a stage's memory is the sum of its units' ``weight_bytes``, plus each shared weight
  used by any of its units (counted once per stage), plus the largest
  ``workspace_bytes`` of its units, plus
  ``(in_bytes + out_bytes) * (1 + queue_depth)`` where ``in_bytes`` is ``input_bytes``
  for the first stage and the previous unit's ``out_bytes`` otherwise; it must be at
  most the device's ``memory_bytes``.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, model_validator

from protocols.base import FrozenModel
from protocols.constants import DEFAULT_QUEUE_DEPTH, PROBLEM_FORMAT
from protocols.links import Link, Requester, check_links, check_requester


class Unit(FrozenModel):
    """One step of the chain: the smallest piece the planner places."""

    name: str
    weight_bytes: NonNegativeInt
    out_bytes: NonNegativeInt
    compute_s: dict[str, NonNegativeFloat]
    """Seconds per micro-batch, keyed by device type."""
    workspace_bytes: NonNegativeInt = 0
    """Peak activation workspace while the unit runs; a stage adds the largest of its units'."""


class SharedWeight(FrozenModel):
    """A weight used by several units (a tied embedding): counted once in each stage using it."""

    name: str
    bytes: NonNegativeInt
    units: list[NonNegativeInt] = Field(min_length=1)


class ProblemDevice(FrozenModel):
    """A device the planner may use."""

    name: str = Field(min_length=1)
    type: str = Field(min_length=1)
    memory_bytes: NonNegativeInt
    bandwidth_mbps: PositiveFloat


class PlanningProblem(FrozenModel):
    """A ``fedshard.problem/1`` document."""

    format: Literal["fedshard.problem/1"] = PROBLEM_FORMAT
    name: str = ""
    input_bytes: NonNegativeInt = 0
    queue_depth: NonNegativeInt = DEFAULT_QUEUE_DEPTH
    units: list[Unit] = Field(min_length=1)
    devices: list[ProblemDevice] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)
    shared_weights: list[SharedWeight] = Field(default_factory=list)
    requester: Requester | None = None
    """Where inputs come from and results go back to; ``None``: neither is counted."""

    @model_validator(mode="after")
    def _check_references(self) -> Self:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError("device names must be unique")
        types = {d.type for d in self.devices}
        for i, unit in enumerate(self.units):
            missing = types - unit.compute_s.keys()
            if missing:
                raise ValueError(f"unit {i} ({unit.name!r}) has no compute_s for {sorted(missing)}")
        check_links(set(names), self.links)
        check_requester(set(names), self.requester)
        for shared in self.shared_weights:
            if any(u >= len(self.units) for u in shared.units):
                raise ValueError(f"shared weight {shared.name!r} names a unit out of range")
        return self
