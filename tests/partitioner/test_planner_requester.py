"""The requester's links: inputs sent to the first stage, results returned from the last.

Hand-computed examples where the requester's link decides the plan, device classes and sender
groups that respect it, validation of the new fields, and the places that carry it over
(``DEVICES.json`` to a planning problem, the ``plan`` table). The exhaustive comparison with a
brute-force oracle on random problems with a requester lives in ``test_planner.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from partitioner.analysis.units import GraphUnit, UnitPlan
from partitioner.cli import plan_cli
from partitioner.planning.fleet import build_fleet
from partitioner.planning.planner import evaluate, plan
from partitioner.planning.problem_from_graph import build_problem
from protocols.devices import DeviceList
from protocols.errors import SchemaError
from protocols.links import Requester, RequesterLink
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

MB = 1_000_000


def _seconds(size: int, bandwidth_mbps: float, latency_ms: float = 0.0) -> float:
    """The transfer formula of ``protocols/problem.py``, operation for operation."""
    return float(size) * 8.0 / (bandwidth_mbps * 1e6) + latency_ms / 1e3


def _two_devices(requester: dict[str, Any] | None) -> PlanningProblem:
    """A fast and a slow device on an 80 Mbit/s LAN; 1 MB in, between units and out.

    Hand-over f<->s: 8 Mbit / 80 Mbit/s = 0.1 s. With ``requester`` given as below, the fast
    device sits behind a 1 Mbit/s link to the requester (8 s each way), the slow one has no
    entry and uses its own 80 Mbit/s (0.1 s each way).
    """
    doc: dict[str, Any] = {
        "input_bytes": MB,
        "queue_depth": 0,
        "units": [
            {
                "name": f"u{i}",
                "weight_bytes": 10,
                "out_bytes": MB,
                "compute_s": {"fast": 1.0, "slow": 2.0},
            }
            for i in range(2)
        ],
        "devices": [
            {"name": "f", "type": "fast", "memory_bytes": 10 * MB, "bandwidth_mbps": 80.0},
            {"name": "s", "type": "slow", "memory_bytes": 10 * MB, "bandwidth_mbps": 80.0},
        ],
    }
    if requester is not None:
        doc["requester"] = requester
    return PlanningProblem.from_obj(doc)


SLOW_TO_FAST = {"links": [{"device": "f", "bandwidth_mbps": 1.0}]}


def _stages(result: Plan) -> list[tuple[str, int, int]]:
    return [(s.device, s.start, s.end) for s in result.stages]


def test_without_a_requester_the_fast_device_takes_everything() -> None:
    # Latency: f alone 2.0 s; s alone 4.0; split either way 1 + 0.1 + 2 = 3.1.
    # Throughput: f alone and both splits have bottleneck 2.0; f alone has the least latency.
    for objective in Objective:
        result = plan(_two_devices(None), objective)
        assert _stages(result) == [("f", 0, 2)]
        assert (result.bottleneck_s, result.latency_s) == (2.0, 2.0)
        assert result.input_transfer_s == 0.0 and result.stages[-1].transfer_s == 0.0


def test_the_requester_link_flips_the_latency_optimum() -> None:
    # f alone 8 + 2 + 8 = 18 s; f->s 8 + 1 + 0.1 + 2 + 0.1 = 11.2; s->f 0.1 + 2 + 0.1 + 1 + 8
    # = 11.2; s alone 0.1 + 4 + 0.1 = 4.2.
    problem = _two_devices(SLOW_TO_FAST)
    result = plan(problem, Objective.LATENCY)
    assert _stages(result) == [("s", 0, 2)]
    near = _seconds(MB, 80.0)
    assert result.latency_s == pytest.approx(4.2)
    assert result.latency_s == ((0.0 + near) + (0.0 + 2.0 + 2.0)) + near
    assert result.input_transfer_s == near == result.stages[-1].transfer_s
    assert result.bottleneck_s == 4.0


def test_the_requester_link_flips_the_throughput_optimum() -> None:
    # f alone has bottleneck 8 (its in-transfer); so has every split (one end is on f);
    # s alone max(0.1, 4, 0.1) = 4.
    result = plan(_two_devices(SLOW_TO_FAST), Objective.THROUGHPUT)
    assert _stages(result) == [("s", 0, 2)]
    assert result.bottleneck_s == 4.0


def test_evaluate_counts_both_ends_in_chain_order() -> None:
    problem = _two_devices(SLOW_TO_FAST)
    result = evaluate(problem, Objective.LATENCY, [("f", 0, 1), ("s", 1, 2)])
    far, near = _seconds(MB, 1.0), _seconds(MB, 80.0)
    assert far == 8.0
    assert result.input_transfer_s == far
    assert [s.transfer_s for s in result.stages] == [near, near]  # hand-over, then back
    assert result.latency_s == (((0.0 + far) + 1.0) + near + 2.0) + near
    assert result.latency_s == pytest.approx(11.2)
    assert result.bottleneck_s == far
    back = evaluate(problem, Objective.LATENCY, [("s", 0, 1), ("f", 1, 2)])
    assert (back.input_transfer_s, back.stages[-1].transfer_s) == (near, far)


def test_a_requester_without_links_uses_each_devices_bandwidth() -> None:
    problem = _two_devices({"links": []})
    result = plan(problem, Objective.LATENCY)
    assert _stages(result) == [("f", 0, 2)]
    assert result.latency_s == ((0.0 + 0.1) + 2.0) + 0.1
    assert result.input_transfer_s == _seconds(MB, 80.0) == 0.1


def test_requester_latency_is_counted() -> None:
    requester = {"links": [{"device": "s", "bandwidth_mbps": 80.0, "latency_ms": 250.0}]}
    result = evaluate(_two_devices(requester), Objective.THROUGHPUT, [("s", 0, 2)])
    assert result.input_transfer_s == _seconds(MB, 80.0, 250.0) == 0.1 + 0.25
    assert result.latency_s == pytest.approx(0.35 + 4.0 + 0.35)


# ----------------------------------------------------------------------------- device classes


def _alike(requester: dict[str, Any] | None) -> PlanningProblem:
    doc: dict[str, Any] = {
        "units": [{"name": "u", "weight_bytes": 1, "out_bytes": 1, "compute_s": {"x": 1.0}}],
        "devices": [
            {"name": f"d{i}", "type": "x", "memory_bytes": 100, "bandwidth_mbps": 100.0}
            for i in range(3)
        ],
    }
    if requester is not None:
        doc["requester"] = requester
    return PlanningProblem.from_obj(doc)


def test_devices_with_different_requester_links_are_not_interchangeable() -> None:
    plain = build_fleet(_alike(None))
    assert [c.devices for c in plain.classes] == [(0, 1, 2)]
    assert plain.requester is None
    slow = build_fleet(_alike({"links": [{"device": "d0", "bandwidth_mbps": 1.0}]}))
    assert [c.devices for c in slow.classes] == [(0,), (1, 2)]
    assert slow.requester == ((1.0, 0.0), (100.0, 0.0))
    # The links between devices are all alike, but the out-transfer differs: two groups.
    assert len(slow.groups) == 2


def test_an_entry_equal_to_the_default_keeps_devices_interchangeable() -> None:
    same = {"links": [{"device": "d1", "bandwidth_mbps": 100.0, "latency_ms": 0.0}]}
    fleet = build_fleet(_alike(same))
    assert [c.devices for c in fleet.classes] == [(0, 1, 2)]
    assert len(fleet.groups) == 1


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([{"device": "ghost", "bandwidth_mbps": 1.0}], "unknown device"),
        ([{"device": "d0", "bandwidth_mbps": 1.0}] * 2, "given twice"),
        ([{"device": "d0", "bandwidth_mbps": 0.0}], "greater than 0"),
        ([{"device": "d0", "bandwidth_mbps": 1.0, "latency_ms": -1.0}], "greater than or equal"),
        ([{"device": "d0", "bandwidth_mbps": 1.0, "extra": 1}], "Extra inputs"),
    ],
)
def test_bad_requester_links_are_refused(links: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        _alike({"links": links})
    devices = {
        "devices": [
            {"name": "d0", "memory_bytes": 1, "gflops": 1.0, "bandwidth_mbps": 1.0},
            {"name": "d1", "memory_bytes": 1, "gflops": 1.0, "bandwidth_mbps": 1.0},
        ],
        "requester": {"links": links},
    }
    with pytest.raises(SchemaError, match=message):
        DeviceList.from_obj(devices)


def test_older_documents_parse_without_the_new_fields() -> None:
    assert _alike(None).requester is None
    devices = DeviceList.from_obj(
        {"devices": [{"name": "a", "memory_bytes": 1, "gflops": 1.0, "bandwidth_mbps": 1.0}]}
    )
    assert devices.requester is None
    stages = [{"device": "a", "start": 0, "end": 1}]
    old = {"objective": "latency", "bottleneck_s": 1.0, "latency_s": 2.0, "stages": stages}
    assert Plan.from_obj(old).input_transfer_s == 0.0


# ----------------------------------------------------------------------------- carried over


def _units() -> UnitPlan:
    units = tuple(GraphUnit(f"u{i}", i, i + 1, 1000, 10, 4, 0, frozenset()) for i in range(2))
    return UnitPlan(units=units, boundaries=(0, 1, 2), input_bytes=8, shared=())


def test_build_problem_carries_the_requester_over() -> None:
    specs = [
        {"name": n, "memory_bytes": 10**6, "gflops": 1.0, "bandwidth_mbps": 100.0}
        for n in ("a", "b")
    ]
    requester = Requester(links=[RequesterLink(device="b", bandwidth_mbps=2.0, latency_ms=3.0)])
    devices = DeviceList.from_obj({"devices": specs, "requester": requester.model_dump()})
    assert build_problem(_units(), devices).requester == requester
    plain = DeviceList.from_obj({"devices": specs})
    assert build_problem(_units(), plain).requester is None


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedshard")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


def test_plan_cli_shows_the_requester_transfers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "problem.json"
    path.write_text(_two_devices(SLOW_TO_FAST).to_json())
    assert _run_cli(["plan", "--problem", str(path), "--objective", "latency"]) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert "requester: input 0.1 s in, result 0.1 s back" in table
    assert "u0 … u1 4 0.1 1.9 MiB" in table  # the last stage's send: back to the requester
    assert _run_cli(["plan", "--problem", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["input_transfer_s"] == 0.1
    assert printed["stages"][-1]["transfer_s"] == 0.1
