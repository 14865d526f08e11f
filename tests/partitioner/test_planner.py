"""The planner equals an exhaustive search, fits memory, and reports infeasibility exactly.

The oracle below is written independently of the planner, straight from the semantics in
``protocols/problem.py``: every ordered selection of devices times every way to cut the chain.
Every property runs on problems without a requester and on problems with one (inputs sent to the
first stage and results returned from the last, over random links, some devices without one).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.errors import InfeasiblePlanError
from partitioner.planning import engine, planner, reach
from partitioner.planning.planner import evaluate, memory_overflows, plan, shortfall_bytes
from protocols.plan import Objective
from protocols.problem import PlanningProblem

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks" / "planner"
VIT_BASE = SHARED / "pipeedge-vit-base-mb4-rcc4-1000mbps.json"

# ----------------------------------------------------------------------------- oracle


@dataclass(frozen=True)
class Scored:
    stages: tuple[tuple[str, int, int], ...]
    bottleneck: float
    latency: float
    overflow: int


def _link(problem: PlanningProblem, a: str, b: str) -> tuple[float, float]:
    for link in problem.links:
        if {link.a, link.b} == {a, b}:
            return link.bandwidth_mbps, link.latency_ms
    devices = {d.name: d for d in problem.devices}
    return min(devices[a].bandwidth_mbps, devices[b].bandwidth_mbps), 0.0


def _memory(problem: PlanningProblem, start: int, end: int) -> int:
    inside = range(start, end)
    weights = sum(problem.units[i].weight_bytes for i in inside)
    shared = sum(w.bytes for w in problem.shared_weights if set(w.units) & set(inside))
    workspace = max(problem.units[i].workspace_bytes for i in inside)
    in_bytes = problem.input_bytes if start == 0 else problem.units[start - 1].out_bytes
    out_bytes = problem.units[end - 1].out_bytes
    return weights + shared + workspace + (in_bytes + out_bytes) * (1 + problem.queue_depth)


def _to_requester(problem: PlanningProblem, name: str, size: int) -> list[float]:
    """The requester's transfer of ``size`` bytes to or from ``name`` (none without one)."""
    if problem.requester is None:
        return []
    device = next(d for d in problem.devices if d.name == name)
    bandwidth, latency = device.bandwidth_mbps, 0.0
    for link in problem.requester.links:
        if link.device == name:
            bandwidth, latency = link.bandwidth_mbps, link.latency_ms
    return [size * 8 / (bandwidth * 1e6) + latency / 1e3]


def _score(problem: PlanningProblem, stages: tuple[tuple[str, int, int], ...]) -> Scored:
    devices = {d.name: d for d in problem.devices}
    computes, overflow = [], -math.inf
    transfers = _to_requester(problem, stages[0][0], problem.input_bytes)
    transfers += _to_requester(problem, stages[-1][0], problem.units[-1].out_bytes)
    for index, (name, start, end) in enumerate(stages):
        kind = devices[name].type
        stage_bytes = sum(u.work.bytes_read for u in problem.units[start:end] if u.work)
        units = sum(_unit_seconds(problem, i, kind, stage_bytes) for i in range(start, end))
        computes.append(units + devices[name].call_us / 1e6 * (devices[name].gflops is not None))
        if index + 1 < len(stages):
            bandwidth, latency = _link(problem, name, stages[index + 1][0])
            out = problem.units[end - 1].out_bytes
            transfers.append(out * 8 / (bandwidth * 1e6) + latency / 1e3)
        overflow = max(overflow, _memory(problem, start, end) - devices[name].memory_bytes)
    bottleneck = max(computes + transfers)
    return Scored(stages, bottleneck, sum(computes) + sum(transfers), int(overflow))


def _unit_seconds(problem: PlanningProblem, index: int, kind: str, stage_bytes: int) -> float:
    """A unit's seconds on a type in a stage reading ``stage_bytes``, straight from the ``/2``
    semantics: its ``compute_s`` entry, else the roofline of its work under the type's roofs."""
    unit = problem.units[index]
    if kind in unit.compute_s:
        return unit.compute_s[kind]
    work = unit.work
    assert work is not None
    device = next(d for d in problem.devices if d.type == kind)
    assert device.gflops is not None
    gemv = min(work.gemv_flops, work.flops) if device.gemv_gflops is not None else 0
    vector = min(work.vector_flops, work.flops - gemv) if device.vector_gflops is not None else 0
    seconds = float(work.flops - gemv - vector) / (device.gflops * 1e9)
    bandwidth = device.memory_gbps
    if device.cache_gbps is not None and stage_bytes <= device.cache_bytes:
        bandwidth = device.cache_gbps
    if bandwidth is not None:
        seconds = max(seconds, float(work.bytes_read) / (bandwidth * 1e9))
    vector_s = 0.0 if device.vector_gflops is None else vector / (device.vector_gflops * 1e9)
    gemv_s = 0.0 if device.gemv_gflops is None else gemv / (device.gemv_gflops * 1e9)
    seconds += vector_s + gemv_s
    # in the documented order (``max(...) + vector + gemv + ops * op_us / 1e6 + topk *
    # topk_ns / 1e9``): the planner must equal this to the last bit, and float addition is
    # not associative
    seconds += float(work.ops) * device.op_us / 1e6
    return seconds + float(work.topk_elements) * device.topk_ns / 1e9


def _arrangements(problem: PlanningProblem) -> Iterator[tuple[tuple[str, int, int], ...]]:
    n = len(problem.units)
    names = [d.name for d in problem.devices]
    for count in range(1, min(len(names), n) + 1):
        for order in itertools.permutations(names, count):
            for cuts in itertools.combinations(range(1, n), count - 1):
                bounds = (0, *cuts, n)
                yield tuple(zip(order, bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True)
class Oracle:
    throughput: Scored | None
    latency: Scored | None
    shortfall: int


def oracle(problem: PlanningProblem) -> Oracle:
    scored = [_score(problem, stages) for stages in _arrangements(problem)]
    fitting = [s for s in scored if s.overflow <= 0]
    shortfall = min(s.overflow for s in scored)
    if not fitting:
        return Oracle(None, None, shortfall)
    best_throughput = min(fitting, key=lambda s: (s.bottleneck, s.latency))
    best_latency = min(fitting, key=lambda s: s.latency)
    return Oracle(best_throughput, best_latency, shortfall)


# ----------------------------------------------------------------------------- instances

TYPES = ("cpu", "gpu", "npu")
COMPUTE = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]),
    st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False),
)


ROOFS = {
    "cpu": {
        "gflops": 2e-9,
        "memory_gbps": 1e-9,
        "cache_bytes": 40,
        "cache_gbps": 4e-9,
        "vector_gflops": 5e-10,
    },
    "gpu": {
        "gflops": 8e-9,
        "memory_gbps": 3e-9,
        "op_us": 1e5,
        "call_us": 5e5,
        "topk_ns": 1e8,
        "gemv_gflops": 1e-9,
    },
    "npu": {"gflops": 1e-9},
}
"""Roofs per type for ``fedshard.problem/2`` instances (tiny rates: a unit takes seconds)."""


@st.composite
def problems(
    draw: st.DrawFn,
    max_devices: int = 4,
    max_units: int = 7,
    requester: bool = False,
    roofline: bool = False,
) -> PlanningProblem:
    """Small instances with ties, shared weights, workspace, links and tight memory; with
    ``requester``, a requester with links to some of the devices; with ``roofline``, a
    ``fedshard.problem/2`` whose devices carry roofs and whose units carry work, some priced
    by ``compute_s`` on some types and by the roofline on the others."""
    n_units = draw(st.integers(1, max_units))
    n_devices = draw(st.integers(1, max_devices))
    kinds = draw(st.lists(st.sampled_from(TYPES), min_size=n_devices, max_size=n_devices))
    weights = draw(st.lists(st.integers(0, 100), min_size=n_units, max_size=n_units))
    units = [
        {
            "name": f"u{i}",
            "weight_bytes": weights[i],
            "out_bytes": draw(st.integers(0, 60)),
            "workspace_bytes": draw(st.sampled_from([0, 0, 10, 40])),
            "compute_s": {kind: draw(COMPUTE) for kind in sorted(set(kinds))},
        }
        for i in range(n_units)
    ]
    shared_bytes = draw(st.lists(st.integers(0, 80), max_size=2))
    shared = [
        {
            "name": f"w{j}",
            "bytes": size,
            "units": draw(st.lists(st.integers(0, n_units - 1), min_size=1, max_size=3)),
        }
        for j, size in enumerate(shared_bytes)
    ]
    queue_depth = draw(st.integers(0, 2))
    input_bytes = draw(st.integers(0, 60))
    need = sum(weights) + sum(shared_bytes) + 40 + 120 * (1 + queue_depth)
    memory = st.one_of(
        st.integers(0, need), st.integers(need // 2, need), st.integers(need // 2, need)
    )
    memories = draw(st.lists(memory, min_size=1, max_size=2))
    bandwidths = draw(st.lists(st.sampled_from([1e-4, 2e-4, 5e-4]), min_size=1, max_size=2))
    devices = [
        {
            "name": f"d{i}",
            "type": kinds[i],
            "memory_bytes": draw(st.sampled_from(memories)),
            "bandwidth_mbps": draw(st.sampled_from(bandwidths)),
        }
        for i in range(n_devices)
    ]
    pairs = list(itertools.combinations(range(n_devices), 2))
    linked = draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    links = [
        {
            "a": f"d{a}",
            "b": f"d{b}",
            "bandwidth_mbps": draw(st.sampled_from([1e-4, 3e-4, 1e-3])),
            "latency_ms": draw(st.sampled_from([0.0, 100.0, 700.0])),
        }
        for a, b in linked
    ]
    if roofline:
        for unit in units:
            unit["work"] = {
                "flops": draw(st.sampled_from([0, 1, 2, 3, 6])),
                "gemv_flops": draw(st.sampled_from([0, 0, 1, 4])),
                "vector_flops": draw(st.sampled_from([0, 0, 1, 2])),
                "bytes_read": draw(st.sampled_from([0, 1, 2, 30, 50, 90])),
                "ops": draw(st.integers(0, 3)),
                "topk_elements": draw(st.sampled_from([0, 0, 4])),
            }
            priced = unit["compute_s"]
            assert isinstance(priced, dict)
            unit["compute_s"] = {k: v for k, v in priced.items() if draw(st.booleans())}
        for device in devices:
            device.update(ROOFS[str(device["type"])])
    document = {
        "format": "fedshard.problem/2" if roofline else "fedshard.problem/1",
        "name": "random",
        "input_bytes": input_bytes,
        "queue_depth": queue_depth,
        "units": units,
        "devices": devices,
        "links": links,
        "shared_weights": shared,
    }
    if requester:
        linked = draw(st.lists(st.integers(0, n_devices - 1), unique=True))
        to_devices = [
            {
                "device": f"d{index}",
                "bandwidth_mbps": draw(st.sampled_from([1e-4, 2e-4, 1e-3])),
                "latency_ms": draw(st.sampled_from([0.0, 0.0, 100.0, 700.0])),
            }
            for index in linked
        ]
        document["requester"] = {"links": to_devices}
    return PlanningProblem.from_obj(document)


def _check_plan_is_honest(problem: PlanningProblem, objective: Objective) -> None:
    result = plan(problem, objective)
    stages = [(s.device, s.start, s.end) for s in result.stages]
    assert evaluate(problem, objective, stages) == result
    assert memory_overflows(problem, result) == []


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REQUESTER = pytest.mark.parametrize("requester", [False, True], ids=["plain", "requester"])


# ----------------------------------------------------------------------------- properties


@REQUESTER
@SETTINGS
@given(st.data())
def test_planner_equals_exhaustive_search(requester: bool, data: st.DataObject) -> None:
    problem = data.draw(problems(requester=requester))
    truth = oracle(problem)
    assert shortfall_bytes(problem) == truth.shortfall
    if truth.throughput is None or truth.latency is None:
        for objective in Objective:
            with pytest.raises(InfeasiblePlanError) as caught:
                plan(problem, objective)
            assert caught.value.shortfall_bytes == truth.shortfall > 0
            assert f"{truth.shortfall} bytes" in str(caught.value)
        return
    throughput = plan(problem, Objective.THROUGHPUT)
    assert throughput.bottleneck_s == truth.throughput.bottleneck
    assert throughput.latency_s == pytest.approx(truth.throughput.latency, rel=1e-9, abs=1e-12)
    latency = plan(problem, Objective.LATENCY)
    assert latency.latency_s == pytest.approx(truth.latency.latency, rel=1e-9, abs=1e-12)
    for objective in Objective:
        _check_plan_is_honest(problem, objective)


@REQUESTER
@SETTINGS
@given(st.data())
def test_roofline_planner_equals_exhaustive_search(requester: bool, data: st.DataObject) -> None:
    """``fedshard.problem/2``: units priced by the roofline of their work on each type's roofs
    (memory, cache or compute bound, plus operator cost), or by ``compute_s`` where given."""
    problem = data.draw(problems(requester=requester, roofline=True))
    truth = oracle(problem)
    if truth.throughput is None or truth.latency is None:
        with pytest.raises(InfeasiblePlanError):
            plan(problem, Objective.THROUGHPUT)
        return
    throughput = plan(problem, Objective.THROUGHPUT)
    assert throughput.bottleneck_s == truth.throughput.bottleneck
    assert throughput.latency_s == pytest.approx(truth.throughput.latency, rel=1e-9, abs=1e-12)
    latency = plan(problem, Objective.LATENCY)
    assert latency.latency_s == pytest.approx(truth.latency.latency, rel=1e-9, abs=1e-12)
    for objective in Objective:
        _check_plan_is_honest(problem, objective)


@REQUESTER
@SETTINGS
@given(st.data())
def test_bottleneck_search_equals_exhaustive_search(requester: bool, data: st.DataObject) -> None:
    """The bit-set search for ``B*`` and the blocked programme, forced on small instances."""
    problem = data.draw(problems(requester=requester))
    truth = oracle(problem)
    setup = planner._prepare(problem)
    searched = planner.least_bottleneck(setup, search=True)
    assert searched == planner.least_bottleneck(setup, search=False)
    if truth.throughput is None or truth.latency is None:
        assert searched == math.inf
        return
    assert searched == truth.throughput.bottleneck
    with mock.patch.object(planner, "SEARCH_ABOVE", 0), mock.patch.object(engine, "BLOCK", 1):
        throughput = plan(problem, Objective.THROUGHPUT)
        latency = plan(problem, Objective.LATENCY)
        for objective in Objective:
            _check_plan_is_honest(problem, objective)
    assert throughput.bottleneck_s == truth.throughput.bottleneck
    assert throughput.latency_s == pytest.approx(truth.throughput.latency, rel=1e-9, abs=1e-12)
    assert latency.latency_s == pytest.approx(truth.latency.latency, rel=1e-9, abs=1e-12)


@REQUESTER
@SETTINGS
@given(st.data())
def test_feasibility_matches_exhaustive_search(requester: bool, data: st.DataObject) -> None:
    """``feasible(B)`` iff some fitting arrangement has bottleneck at most ``B``."""
    problem = data.draw(problems(requester=requester))
    scored = [_score(problem, stages) for stages in _arrangements(problem)]
    fitting = sorted({s.bottleneck for s in scored if s.overflow <= 0})
    bound = data.draw(st.sampled_from([*fitting, 0.0, 0.5, 2.0, 1e9]))
    setup = planner._prepare(problem)
    costs = reach.Costs(
        setup.fleet,
        setup.compute,
        setup.transfer,
        setup.rest,
        setup.capacity,
        inbound=setup.inbound,
        outbound=setup.outbound,
    )
    expected = any(b <= bound for b in fitting)
    forward = reach.forward(costs, bound)
    assert bool(forward[-1].any()) == expected == reach.feasible(costs, bound)


@given(st.lists(st.booleans(), min_size=1, max_size=200), st.integers(0, 200))
def test_bit_set_shifts(bits: list[bool], by: int) -> None:
    packed = reach.pack(np.array(bits))
    number = sum(1 << i for i, b in enumerate(bits) if b)
    words = packed.shape[-1]
    mask = (1 << (64 * words)) - 1

    def value(sets: reach.Words) -> int:
        return sum(int(w) << (64 * i) for i, w in enumerate(sets))

    assert value(packed) == number
    assert value(reach.shift_up(packed, by)) == (number << by) & mask


@REQUESTER
@SETTINGS
@given(st.data())
def test_evaluate_agrees_with_oracle(requester: bool, data: st.DataObject) -> None:
    problem = data.draw(problems(max_devices=4, max_units=5, requester=requester))
    arrangement = data.draw(st.sampled_from(list(_arrangements(problem))))
    expected = _score(problem, arrangement)
    for objective in Objective:
        result = evaluate(problem, objective, arrangement)
        assert result.objective is objective
        assert result.bottleneck_s == expected.bottleneck
        assert result.latency_s == pytest.approx(expected.latency, rel=1e-12, abs=1e-15)
        worst = max(s.memory_bytes - _memory_of(problem, s.device) for s in result.stages)
        assert worst == expected.overflow
        assert [(s.device, s.start, s.end) for s in result.stages] == list(arrangement)
        sent_in = _to_requester(problem, arrangement[0][0], problem.input_bytes) or [0.0]
        sent_back = _to_requester(problem, arrangement[-1][0], problem.units[-1].out_bytes)
        assert [result.input_transfer_s] == sent_in
        assert [result.stages[-1].transfer_s] == (sent_back or [0.0])


def _memory_of(problem: PlanningProblem, name: str) -> int:
    return next(d.memory_bytes for d in problem.devices if d.name == name)


# ----------------------------------------------------------------------------- examples


def _chain(**overrides: object) -> PlanningProblem:
    data: dict[str, object] = {
        "input_bytes": 10,
        "queue_depth": 0,
        "units": [
            {"name": f"u{i}", "weight_bytes": 100, "out_bytes": 10, "compute_s": {"x": 1.0}}
            for i in range(4)
        ],
        "devices": [
            {"name": f"d{i}", "type": "x", "memory_bytes": 500, "bandwidth_mbps": 1.0}
            for i in range(4)
        ],
    }
    data.update(overrides)
    return PlanningProblem.from_obj(data)


def test_identical_devices_split_evenly() -> None:
    result = plan(_chain(), Objective.THROUGHPUT)
    assert [(s.start, s.end) for s in result.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert result.bottleneck_s == 1.0


def test_latency_prefers_one_device_when_it_fits() -> None:
    result = plan(_chain(), Objective.LATENCY)
    assert [(s.device, s.start, s.end) for s in result.stages] == [("d0", 0, 4)]
    assert result.latency_s == 4.0


def test_infeasible_reports_shortfall() -> None:
    devices = [{"name": "d0", "type": "x", "memory_bytes": 300, "bandwidth_mbps": 1.0}]
    problem = _chain(devices=devices)
    with pytest.raises(InfeasiblePlanError) as caught:
        plan(problem)
    # One device holds all four units: 400 weights + (10 + 10) buffers = 420 bytes.
    assert caught.value.shortfall_bytes == 120
    assert "120 bytes" in str(caught.value)


def test_memory_that_shrinks_with_a_later_cut_is_used() -> None:
    """A longer stage can need less memory when its frontier is smaller."""
    units = [
        {"name": "a", "weight_bytes": 10, "out_bytes": 500, "compute_s": {"x": 1.0}},
        {"name": "b", "weight_bytes": 10, "out_bytes": 1, "compute_s": {"x": 1.0}},
        {"name": "c", "weight_bytes": 10, "out_bytes": 1, "compute_s": {"x": 1.0}},
    ]
    devices = [
        {"name": f"d{i}", "type": "x", "memory_bytes": 40, "bandwidth_mbps": 1.0} for i in range(3)
    ]
    result = plan(_chain(units=units, devices=devices, input_bytes=1))
    assert [(s.start, s.end) for s in result.stages] == [(0, 2), (2, 3)]


def test_links_decide_the_order() -> None:
    slow = [("d0", "d1"), ("d1", "d2")]
    links = [{"a": a, "b": b, "bandwidth_mbps": 1e-6, "latency_ms": 0.0} for a, b in slow]
    result = plan(_chain(links=links), Objective.THROUGHPUT)
    order = [s.device for s in result.stages]
    assert len(order) == 4
    pairs = {frozenset(pair) for pair in itertools.pairwise(order)}
    assert pairs.isdisjoint({frozenset(pair) for pair in slow})
    assert result.bottleneck_s == 1.0


def test_evaluate_rejects_broken_arrangements() -> None:
    problem = _chain()
    for broken in (
        [],
        [("d0", 0, 2)],
        [("d0", 0, 2), ("d0", 2, 4)],
        [("d0", 0, 2), ("d1", 3, 4)],
        [("nope", 0, 4)],
        [("d0", 0, 0), ("d1", 0, 4)],
    ):
        with pytest.raises(ValueError):
            evaluate(problem, Objective.THROUGHPUT, broken)


@pytest.mark.skipif(not VIT_BASE.exists(), reason=f"shared benchmarks not present at {SHARED}")
def test_vit_base_on_mb4_rcc4_matches_corrected_pipeedge() -> None:
    problem = PlanningProblem.from_json(VIT_BASE.read_text())
    result = plan(problem, Objective.THROUGHPUT)
    assert round(result.bottleneck_s, 4) == 1.5488
    assert memory_overflows(problem, result) == []
    assert (
        evaluate(problem, Objective.THROUGHPUT, [(s.device, s.start, s.end) for s in result.stages])
        == result
    )
