"""Scale, device classes and baselines: synthetic 16 x 200 and 100B problems, exo and even."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from partitioner.errors import InfeasiblePlanError
from partitioner.planning import synthetic
from partitioner.planning.baselines import Baseline, baseline_arrangement, run_baseline
from partitioner.planning.fleet import build_fleet
from partitioner.planning.planner import PlanningInputError, evaluate, memory_overflows, plan
from partitioner.planning.semantics import stage_memory
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks" / "planner"


def _honest(problem: PlanningProblem, result: Plan) -> None:
    arrangement = [(s.device, s.start, s.end) for s in result.stages]
    assert evaluate(problem, result.objective, arrangement) == result
    assert memory_overflows(problem, result) == []


@pytest.mark.parametrize("objective", list(Objective))
def test_home_lab_16_devices_200_units(objective: Objective) -> None:
    problem = synthetic.decoder_problem(synthetic.MID_20B, synthetic.HOME_LAB_16)
    assert (len(problem.devices), len(problem.units)) == (16, 200)
    result = plan(problem, objective)
    _honest(problem, result)
    for baseline in Baseline:
        scored = run_baseline(problem, objective, baseline)
        if scored.fits and objective is Objective.THROUGHPUT:
            assert result.bottleneck_s <= scored.plan.bottleneck_s
        if scored.fits and objective is Objective.LATENCY:
            assert result.latency_s <= scored.plan.latency_s


@pytest.mark.parametrize("tied", [False, True])
def test_100b_decoder_plans_across_devices_that_hold_it(tied: bool) -> None:
    shape = dataclasses.replace(synthetic.LLAMA_100B, tied_embeddings=tied)
    assert shape.params >= 100e9
    problem = synthetic.decoder_problem(shape, synthetic.CLUSTER_100B)
    weights = sum(u.weight_bytes for u in problem.units) + sum(
        w.bytes for w in problem.shared_weights
    )
    assert weights > max(d.memory_bytes for d in problem.devices)
    assert weights < sum(d.memory_bytes for d in problem.devices)
    for objective in Objective:
        result = plan(problem, objective)
        _honest(problem, result)
        assert len(result.stages) > 1


def test_100b_decoder_on_too_few_devices_reports_the_shortfall() -> None:
    kinds = (synthetic.DeviceKind("laptop", 4, 16 * synthetic.GIB, 2500.0),)
    problem = synthetic.decoder_problem(synthetic.LLAMA_100B, kinds)
    with pytest.raises(InfeasiblePlanError) as caught:
        plan(problem)
    # Four stages must hold everything, so the fullest holds at least a quarter of the weights.
    weights = sum(u.weight_bytes for u in problem.units)
    assert caught.value.shortfall_bytes >= weights // 4 - 16 * synthetic.GIB


def _with_requester(problem: PlanningProblem, slow: str, mbps: float) -> PlanningProblem:
    """``problem`` with a requester behind a ``mbps`` link to every device of type ``slow``
    (the others use their own bandwidth)."""
    links = [
        {"device": d.name, "bandwidth_mbps": mbps, "latency_ms": 2.0}
        for d in problem.devices
        if d.type == slow
    ]
    return PlanningProblem.from_obj({**problem.model_dump(), "requester": {"links": links}})


@pytest.mark.parametrize(
    ("kinds", "slow"),
    [(synthetic.HOME_LAB_16, "jetson-orin"), (synthetic.distinct_kinds(12), "jetson-orin")],
    ids=["home-lab", "distinct"],
)
def test_requester_links_at_scale(kinds: tuple[synthetic.DeviceKind, ...], slow: str) -> None:
    """Exact with a requester on 16 and 12 devices (the search path for the distinct ones): the
    optimum never loses to the plan made without the requester, nor to a fitting baseline."""
    plain = synthetic.decoder_problem(synthetic.MID_20B, kinds)
    problem = _with_requester(plain, slow, 2.0)
    for objective in Objective:
        result = plan(problem, objective)
        _honest(problem, result)
        assert result.input_transfer_s > 0 and result.stages[-1].transfer_s > 0
        rivals = [evaluate(problem, objective, _arrangement(plan(plain, objective)))]
        rivals += [
            scored.plan
            for baseline in Baseline
            if (scored := run_baseline(problem, objective, baseline)).fits
        ]
        for rival in rivals:
            if objective is Objective.THROUGHPUT:
                assert result.bottleneck_s <= rival.bottleneck_s
            else:
                assert result.latency_s <= rival.latency_s


def _arrangement(result: Plan) -> list[tuple[str, int, int]]:
    return [(s.device, s.start, s.end) for s in result.stages]


def test_device_classes() -> None:
    home = build_fleet(synthetic.decoder_problem(synthetic.MID_20B, synthetic.HOME_LAB_16))
    assert sorted(len(c.devices) for c in home.classes) == [1, 1, 2, 2, 2, 4, 4]
    # Laptops hand over at 300 Mbps, desktops to each other at 2500, everything else at 1000.
    assert len(home.groups) == 3
    lan = build_fleet(
        synthetic.decoder_problem(synthetic.MID_20B, synthetic.distinct_kinds(6, True))
    )
    assert (len(lan.classes), len(lan.groups)) == (6, 1)
    # Jetsons behind a slow link to the requester: same classes, but no longer in one sender
    # group with the Raspberry Pis (their results go back more slowly).
    plain = synthetic.decoder_problem(synthetic.MID_20B, synthetic.HOME_LAB_16)
    remote = build_fleet(_with_requester(plain, "jetson-orin", 2.0))
    assert [c.devices for c in remote.classes] == [c.devices for c in home.classes]
    assert len(remote.groups) == 4


def test_a_link_separates_otherwise_identical_devices() -> None:
    problem = synthetic.decoder_problem(
        synthetic.MID_20B, (synthetic.DeviceKind("rpi5", 3, 8 * synthetic.GIB, 30.0),)
    )
    assert len(build_fleet(problem).classes) == 1
    names = [d.name for d in problem.devices]
    slow = {"a": names[0], "b": names[1], "bandwidth_mbps": 10.0, "latency_ms": 5.0}
    linked = PlanningProblem.from_obj({**problem.model_dump(), "links": [slow]})
    assert sorted(len(c.devices) for c in build_fleet(linked).classes) == [1, 2]


def _units(count: int) -> list[dict[str, object]]:
    return [
        {"name": f"u{i}", "weight_bytes": 10, "out_bytes": 1, "compute_s": {"x": 1.0}}
        for i in range(count)
    ]


def _devices(memories: dict[str, int]) -> list[dict[str, object]]:
    return [
        {"name": name, "type": "x", "memory_bytes": memory, "bandwidth_mbps": 1.0}
        for name, memory in memories.items()
    ]


def test_exo_splits_by_memory_largest_first() -> None:
    problem = PlanningProblem.from_obj(
        {"units": _units(8), "devices": _devices({"a": 100, "b": 200, "c": 100})}
    )
    # Sorted by (memory, name) descending: b, c, a with shares 0.5, 0.25, 0.25.
    assert baseline_arrangement(problem, Baseline.EXO) == [("b", 0, 4), ("c", 4, 6), ("a", 6, 8)]


def test_exo_leaves_out_devices_too_small_for_a_unit() -> None:
    problem = PlanningProblem.from_obj(
        {"units": _units(3), "devices": _devices({"a": 1000, "b": 10, "c": 5})}
    )
    # b's share rounds to no unit; c, the last device, takes what is left.
    assert baseline_arrangement(problem, Baseline.EXO) == [("a", 0, 2), ("c", 2, 3)]


def test_even_split() -> None:
    problem = PlanningProblem.from_obj(
        {"units": _units(7), "devices": _devices({"a": 1, "b": 1, "c": 1})}
    )
    assert baseline_arrangement(problem, Baseline.EVEN) == [("a", 0, 3), ("b", 3, 5), ("c", 5, 7)]
    few = PlanningProblem.from_obj(
        {"units": _units(2), "devices": _devices({"a": 1, "b": 1, "c": 1})}
    )
    assert baseline_arrangement(few, Baseline.EVEN) == [("a", 0, 1), ("b", 1, 2)]


def test_baseline_overflow_is_reported() -> None:
    problem = PlanningProblem.from_obj(
        {"units": _units(4), "devices": _devices({"a": 20, "b": 20})}
    )
    scored = run_baseline(problem, Objective.THROUGHPUT, Baseline.EVEN)
    assert not scored.fits
    first, second = stage_memory(problem, 0, 2), stage_memory(problem, 2, 4)
    assert scored.overflows == [("a", first - 20), ("b", second - 20)]


@pytest.mark.skipif(not SHARED.exists(), reason=f"shared benchmarks not present at {SHARED}")
def test_optimum_never_loses_to_a_fitting_baseline() -> None:
    files = sorted(SHARED.glob("*.json"))
    assert len(files) == 24
    for path in files:
        problem = PlanningProblem.from_json(path.read_text())
        best = {objective: plan(problem, objective) for objective in Objective}
        for baseline in Baseline:
            scored = run_baseline(problem, Objective.THROUGHPUT, baseline)
            if scored.fits:
                assert best[Objective.THROUGHPUT].bottleneck_s <= scored.plan.bottleneck_s
                assert best[Objective.LATENCY].latency_s <= scored.plan.latency_s


def test_too_many_distinct_devices_is_refused_up_front() -> None:
    problem = synthetic.decoder_problem(synthetic.MID_20B, synthetic.distinct_kinds(18))
    with pytest.raises(PlanningInputError, match="kinds of device"):
        plan(problem)


def test_byte_counts_beyond_exact_float_range_are_refused() -> None:
    units = [{"name": "u", "weight_bytes": 2**53, "out_bytes": 1, "compute_s": {"x": 1.0}}]
    problem = PlanningProblem.from_obj({"units": units, "devices": _devices({"a": 2**60})})
    with pytest.raises(PlanningInputError, match="exactly"):
        plan(problem)
