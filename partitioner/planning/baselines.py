"""Baseline splits the planner is measured against, scored under the same exact semantics.

- :attr:`Baseline.EXO`: exo's ring memory-weighted split. Devices are ordered by memory, largest
  first (ties by name, descending, as exo sorts by ``(memory, node id)`` in reverse); each gets
  the slice ``[start, end)`` of the unit interval in proportion to its memory, with ``end``
  rounded to 5 decimals; units ``[int(start * n), int(end * n))`` go to it, the last device takes
  everything left, and devices whose share rounds to no unit are left out.
- :attr:`Baseline.EVEN`: every device in problem order gets ``n // D`` units, the first
  ``n % D`` one more (distributed-llama style); with more devices than units, the extra devices
  are left out.

Neither looks at compute or links, and neither checks memory: :func:`run_baseline` reports every
stage that does not fit instead of hiding it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from partitioner.planning.semantics import Arrangement, evaluate, memory_overflows
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem


class Baseline(StrEnum):
    """A baseline split, by the name the CLI and benchmarks use."""

    EXO = "exo"
    """exo's ring memory-weighted split."""
    EVEN = "even"
    """An even split over all devices."""


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's plan, scored exactly, with the stages that overflow their device."""

    baseline: Baseline
    plan: Plan
    overflows: list[tuple[str, int]]
    """``(device, bytes over its memory)`` per stage that does not fit."""

    @property
    def fits(self) -> bool:
        """Whether every stage fits its device."""
        return not self.overflows


def baseline_arrangement(problem: PlanningProblem, baseline: Baseline) -> Arrangement:
    """The stages ``baseline`` picks for ``problem``, in chain order."""
    if baseline is Baseline.EXO:
        return _memory_weighted(problem)
    return _even(problem)


def run_baseline(
    problem: PlanningProblem, objective: Objective, baseline: Baseline
) -> BaselineResult:
    """Split ``problem`` the way ``baseline`` does and score it under ``objective``."""
    plan = evaluate(problem, objective, baseline_arrangement(problem, baseline))
    return BaselineResult(baseline=baseline, plan=plan, overflows=memory_overflows(problem, plan))


def _memory_weighted(problem: PlanningProblem) -> Arrangement:
    n = len(problem.units)
    devices = sorted(problem.devices, key=lambda d: (d.memory_bytes, d.name), reverse=True)
    total = sum(d.memory_bytes for d in devices)
    shares = [d.memory_bytes / total if total else 1 / len(devices) for d in devices]
    stages: list[tuple[str, int, int]] = []
    start = 0.0
    for index, (device, share) in enumerate(zip(devices, shares, strict=True)):
        end = round(start + share, 5)
        first = min(n, int(start * n))
        last = n if index == len(devices) - 1 else min(n, int(end * n))
        if first < last:
            stages.append((device.name, first, last))
        start = end
    if stages[-1][2] < n:
        name, first, _ = stages[-1]
        stages[-1] = (name, first, n)
    return stages


def _even(problem: PlanningProblem) -> Arrangement:
    n = len(problem.units)
    devices = problem.devices[: min(n, len(problem.devices))]
    size, extra = divmod(n, len(devices))
    stages = []
    start = 0
    for index, device in enumerate(devices):
        end = start + size + (1 if index < extra else 0)
        stages.append((device.name, start, end))
        start = end
    return stages
