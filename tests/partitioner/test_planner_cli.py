"""``fedshard plan``: JSON and table output, baselines, and exit codes for bad input."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from partitioner.cli import plan_cli
from partitioner.planning.planner import evaluate
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks" / "planner"
VIT_BASE = SHARED / "pipeedge-vit-base-mb4-rcc4-1000mbps.json"

PROBLEM = {
    "format": "fedshard.problem/1",
    "name": "tiny",
    "input_bytes": 1000,
    "queue_depth": 2,
    "units": [
        {"name": f"u{i}", "weight_bytes": 4000, "out_bytes": 1000, "compute_s": {"cpu": 1.0}}
        for i in range(6)
    ],
    "devices": [
        {"name": "big", "type": "cpu", "memory_bytes": 20_000, "bandwidth_mbps": 100.0},
        {"name": "small-a", "type": "cpu", "memory_bytes": 15_000, "bandwidth_mbps": 100.0},
        {"name": "small-b", "type": "cpu", "memory_bytes": 15_000, "bandwidth_mbps": 100.0},
    ],
}


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedshard")
    plan_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


def _write(tmp_path: Path, data: object, name: str = "problem.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_json_output_is_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, PROBLEM)
    assert _run(["plan", "--problem", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {"objective", "bottleneck_s", "latency_s", "stages"} <= printed.keys()
    assert printed["objective"] == "throughput"
    stages = printed["stages"]
    assert stages[0]["start"] == 0 and stages[-1]["end"] == 6
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(stages))
    assert {s["device"] for s in stages} == {"big", "small-a", "small-b"}
    plan = Plan.model_validate(printed)
    problem = PlanningProblem.from_obj(PROBLEM)
    arrangement = [(s.device, s.start, s.end) for s in plan.stages]
    assert evaluate(problem, Objective.THROUGHPUT, arrangement) == plan


def test_latency_objective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, PROBLEM)
    assert _run(["plan", "--problem", str(path), "--objective", "latency", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["objective"] == "latency"
    assert printed["latency_s"] == pytest.approx(6.0 + 2 * 1000 * 8 / 100e6)


def test_table_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, PROBLEM)
    assert _run(["plan", "--problem", str(path)]) == 0
    out = capsys.readouterr().out
    for expected in ("tiny", "big", "small-a", "small-b", "bottleneck", "latency", "[0, "):
        assert expected in out


def test_infeasible_exits_2_with_shortfall(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = dict(PROBLEM, devices=PROBLEM["devices"][1:])  # type: ignore[index]
    path = _write(tmp_path, data)
    assert _run(["plan", "--problem", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # Each stage holds 4000 bytes per unit plus (1000 + 1000) * 3 of buffers, so a 15 000-byte
    # device takes two units; the best split, three and three, needs 18 000.
    assert "3000 bytes" in captured.err


def test_bad_problem_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = dict(PROBLEM, units=[])
    path = _write(tmp_path, broken)
    assert _run(["plan", "--problem", str(path)]) == 2
    assert "invalid PlanningProblem" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert _run(["plan", "--problem", str(garbage)]) == 2
    assert "invalid PlanningProblem" in capsys.readouterr().err


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--problem", str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_unknown_objective_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, PROBLEM)
    with pytest.raises(SystemExit) as caught:
        _run(["plan", "--problem", str(path), "--objective", "fastest"])
    assert caught.value.code == 2


def test_baseline_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roomy = dict(PROBLEM, devices=[dict(d, memory_bytes=30_000) for d in PROBLEM["devices"]])  # type: ignore[attr-defined]
    path = _write(tmp_path, roomy)
    assert _run(["plan", "--problem", str(path), "--baseline", "even", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(s["start"], s["end"]) for s in printed["stages"]] == [(0, 2), (2, 4), (4, 6)]


def test_baseline_that_overflows_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tight = dict(PROBLEM, devices=[dict(d, memory_bytes=9_000) for d in PROBLEM["devices"]])  # type: ignore[attr-defined]
    path = _write(tmp_path, tight)
    assert _run(["plan", "--problem", str(path), "--baseline", "exo"]) == 1
    captured = capsys.readouterr()
    assert "OVER" in captured.out
    assert "does not fit" in captured.err


@pytest.mark.skipif(not VIT_BASE.exists(), reason=f"shared benchmarks not present at {SHARED}")
def test_vit_base_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["plan", "--problem", str(VIT_BASE), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert round(printed["bottleneck_s"], 4) == 1.5488


def test_problem_too_large_to_plan_exactly_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = dict(PROBLEM, units=[dict(PROBLEM["units"][0], weight_bytes=2**53)])  # type: ignore[index]
    path = _write(tmp_path, huge)
    assert _run(["plan", "--problem", str(path)]) == 2
    assert "exactly" in capsys.readouterr().err
