"""``fedshard plan`` says what its default does, and ``--exact`` gives the stated optimum.

The default prefers a plan on one device within ``ONE_DEVICE_MARGIN`` (5 %) of the optimum, as
``fedshard split`` and the coordinator do; the problem here is one where that margin bites: two
devices give a bottleneck of 1.0 s, one device alone 1.04 s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from partitioner.cli import plan_cli
from partitioner.planning.planner import (
    ONE_DEVICE_MARGIN,
    choose_with_margin,
    plan,
    plan_preferring_one_device,
)
from protocols.plan import Objective
from protocols.problem import PlanningProblem

NEAR = {
    "format": "fedshard.problem/1",
    "name": "near",
    "input_bytes": 10,
    "queue_depth": 1,
    "units": [
        {"name": "heavy", "weight_bytes": 1000, "out_bytes": 10, "compute_s": {"cpu": 1.0}},
        {"name": "light", "weight_bytes": 1000, "out_bytes": 10, "compute_s": {"cpu": 0.04}},
    ],
    "devices": [
        {"name": "a", "type": "cpu", "memory_bytes": 1_000_000, "bandwidth_mbps": 1000.0},
        {"name": "b", "type": "cpu", "memory_bytes": 1_000_000, "bandwidth_mbps": 1000.0},
    ],
}
FAR = {**NEAR, "name": "far", "units": [{**u, "compute_s": {"cpu": 1.0}} for u in NEAR["units"]]}


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedshard")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(data))
    return path


def test_the_margin_bites_on_this_problem() -> None:
    problem = PlanningProblem.from_obj(NEAR)
    optimum = plan(problem, Objective.THROUGHPUT)
    assert len(optimum.stages) == 2
    assert optimum.bottleneck_s == pytest.approx(1.0, abs=1e-6)
    choice = choose_with_margin(problem, Objective.THROUGHPUT)
    assert choice.margin_applied and choice.optimum == optimum
    assert len(choice.chosen.stages) == 1
    assert choice.chosen.bottleneck_s == pytest.approx(1.04)
    assert choice.chosen.bottleneck_s <= (1 + ONE_DEVICE_MARGIN) * optimum.bottleneck_s
    assert plan_preferring_one_device(problem, Objective.THROUGHPUT) == choice.chosen


def test_default_prefers_one_device_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, NEAR)
    assert _run(["plan", "--problem", str(path)]) == 0
    out = capsys.readouterr().out
    assert "within 5% of optimal for throughput" in out
    assert "note: one device (" in out and "--exact prints the optimum" in out
    assert "on 2 devices" in out

    assert _run(["plan", "--problem", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # stdout stays one JSON document
    assert len(printed["stages"]) == 1
    assert printed["bottleneck_s"] == pytest.approx(1.04)
    assert "note: one device (" in captured.err


def test_exact_prints_the_optimum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, NEAR)
    assert _run(["plan", "--problem", str(path), "--exact", "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert [s["device"] for s in printed["stages"]] in (["a", "b"], ["b", "a"])
    assert printed["bottleneck_s"] == pytest.approx(1.0, abs=1e-6)
    assert "note:" not in captured.err

    assert _run(["plan", "--problem", str(path), "--exact"]) == 0
    out = capsys.readouterr().out
    assert "optimal for throughput" in out and "within" not in out and "note:" not in out


def test_no_note_when_the_optimum_stands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, FAR)
    assert _run(["plan", "--problem", str(path)]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "optimal for throughput" in out
    problem = PlanningProblem.from_obj(FAR)
    assert not choose_with_margin(problem, Objective.THROUGHPUT).margin_applied


def test_help_states_the_default_and_the_exact_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "within 5% of the optimum is preferred" in text
    assert "--exact" in text and "print the optimum of the stated problem" in text
