"""Deploying a baseline split (for comparisons in the lab): the planner the deployer uses."""

from __future__ import annotations

import pytest

from coordinator.deploy.cutting import baseline_planner
from partitioner.errors import InfeasiblePlanError
from partitioner.planning.baselines import Baseline
from protocols.plan import Objective
from protocols.problem import PlanningProblem


def _problem(memory: list[int]) -> PlanningProblem:
    return PlanningProblem.from_obj(
        {
            "units": [
                {"name": f"u{i}", "weight_bytes": 100, "out_bytes": 10, "compute_s": {"t": 1.0}}
                for i in range(6)
            ],
            "devices": [
                {"name": f"d{i}", "type": "t", "memory_bytes": m, "bandwidth_mbps": 1000.0}
                for i, m in enumerate(memory)
            ],
        }
    )


def test_even_split_gives_every_device_the_same_share() -> None:
    plan = baseline_planner(Baseline.EVEN)(_problem([1000, 1000, 1000]), Objective.THROUGHPUT)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4), (4, 6)]


def test_a_baseline_stage_that_does_not_fit_is_refused_with_the_overflow() -> None:
    with pytest.raises(InfeasiblePlanError, match="even split overflows") as caught:
        baseline_planner(Baseline.EVEN)(_problem([1000, 150, 1000]), Objective.THROUGHPUT)
    assert caught.value.shortfall_bytes > 0
