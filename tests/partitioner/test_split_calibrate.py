"""``fedshard split --calibrate``: per-unit timing in ONNX Runtime and the calibrated problem.

Assertions are on shares, orderings and plans derived from measured data, never on absolute
wall time: the deliberately expensive unit (a chain of ``Sin``/``Cos`` that FLOP counting
prices at one operation per element) costs well over ten times its FLOP share on any CPU.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from graph_helpers import OPSET, block_stack
from onnx import TensorProto, helper, numpy_helper

from partitioner.analysis.units import GraphUnit, UnitPlan
from partitioner.cli import split_cli
from partitioner.cutting import split
from partitioner.cutting.calibrate import Calibration, shares_of, time_chain
from partitioner.cutting.inputs import Analysis, SplitOptions
from partitioner.cutting.split import analyse, split_model
from partitioner.errors import CalibrationError, GraphError, InfeasiblePlanError
from partitioner.planning.problem_from_graph import build_problem
from protocols.devices import DeviceList
from protocols.manifest import Manifest

WIDTH = 64
BATCH = 256


def _devices(gflops: list[float], memory: int = 10**9, bandwidth: float = 10_000.0) -> DeviceList:
    return DeviceList.from_obj(
        {
            "devices": [
                {"name": f"d{i}", "memory_bytes": memory, "gflops": g, "bandwidth_mbps": bandwidth}
                for i, g in enumerate(gflops)
            ]
        }
    )


def _unit_plan(flops: list[int]) -> UnitPlan:
    units = tuple(
        GraphUnit(f"u{k}", k, k + 1, f, 100, 10, 0, frozenset()) for k, f in enumerate(flops)
    )
    return UnitPlan(units, tuple(range(len(flops) + 1)), 10, ())


# ------------------------------------------------------------------------------ pure shares


def test_shares_sum_to_one_and_follow_the_times() -> None:
    shares = shares_of([1.0, 2.0, 1.0])
    assert shares == [0.25, 0.5, 0.25]
    assert math.isclose(sum(shares_of([0.3, 1e-6, 7.0, 0.0])), 1.0)
    slow, fast = shares_of([2e-3, 1e-3])
    assert math.isclose(slow, 2 * fast)


@pytest.mark.parametrize("times", [[1.0, -1.0], [1.0, math.nan], [math.inf], [0.0, 0.0], []])
def test_shares_refuse_unusable_times(times: list[float]) -> None:
    with pytest.raises(CalibrationError):
        shares_of(times)


def test_the_fastest_run_counts_so_bursts_of_load_do_not() -> None:
    samples = [[3.0, 1.0, 2.0], [5.0, 100.0, 90.0, 4.0]]
    c = Calibration.from_samples(["a", "b"], [1, 1], samples, threads=2)
    assert c.seconds == (1.0, 4.0)
    assert c.median_seconds == (2.0, 47.5)
    assert c.shares == (0.2, 0.8)
    assert (c.runs, c.threads) == (3, 2)
    with pytest.raises(CalibrationError, match="no timed runs"):
        Calibration.from_samples(["a", "b"], [1, 1], [[1.0], []], threads=1)


def test_calibration_reports_both_distributions() -> None:
    times = (1.0, 1.0, 2.0)
    c = Calibration(("a", "b", "c"), (300, 0, 100), times, times, runs=3, threads=1)
    assert c.flop_shares == (0.75, 0.0, 0.25)
    assert c.shares == (0.25, 0.25, 0.5)
    assert c.total_s == 4.0
    assert Calibration(("a",), (0,), (1.0,), (1.0,), runs=1, threads=1).flop_shares == (0.0,)
    with pytest.raises(CalibrationError, match="2 units"):
        Calibration(("a", "b"), (1,), (1.0, 2.0), (1.0, 2.0), runs=1, threads=1)
    assert issubclass(CalibrationError, GraphError)


def test_shares_redistribute_the_model_flops_over_units() -> None:
    units = _unit_plan([1000, 0, 3000])
    devices = _devices([1.0, 4.0])
    plain = build_problem(units, devices)
    assert [u.compute_s["d0"] for u in plain.units] == [1e-6, 0.0, 3e-6]
    calibrated = build_problem(units, devices, compute_shares=[0.2, 0.5, 0.3])
    total_flops = 4000
    for unit, share in zip(calibrated.units, [0.2, 0.5, 0.3], strict=True):
        assert math.isclose(unit.compute_s["d0"], total_flops * share / 1e9)
        assert math.isclose(unit.compute_s["d0"], 4 * unit.compute_s["d1"])  # speeds kept
    zero_flop_unit = calibrated.units[1]
    assert zero_flop_unit.compute_s["d0"] > calibrated.units[0].compute_s["d0"]
    for device in ("d0", "d1"):
        assert math.isclose(
            sum(u.compute_s[device] for u in calibrated.units),
            sum(u.compute_s[device] for u in plain.units),
        )
    assert [u.weight_bytes for u in calibrated.units] == [u.weight_bytes for u in plain.units]
    with pytest.raises(GraphError, match="2 compute shares for 3 units"):
        build_problem(units, devices, compute_shares=[0.5, 0.5])


# ------------------------------------------------------------------------- timing layer


def _tiny(path: Path, op: str = "Relu") -> Path:
    graph = helper.make_graph(
        [helper.make_node(op, ["a"], ["b"])],
        "tiny",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(path))
    return path


def test_time_chain_runs_each_segment_on_earlier_outputs(tmp_path: Path) -> None:
    first = _tiny(tmp_path / "first.onnx")
    second = tmp_path / "second.onnx"
    graph = helper.make_graph(
        [helper.make_node("Neg", ["b"], ["c"])],
        "second",
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=OPSET), str(second))
    feeds = {"a": np.arange(4, dtype=np.float32)}
    samples = time_chain([first, second], feeds, runs=3, warmup=0)
    assert [len(s) for s in samples] == [3, 3]
    assert all(t > 0 for s in samples for t in s)
    with pytest.raises(CalibrationError, match="no value for inputs"):
        time_chain([second], feeds, runs=1)
    with pytest.raises(CalibrationError, match="runs >= 1"):
        time_chain([first], feeds, runs=0)


def test_time_chain_wraps_onnx_runtime_failures(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx file")
    with pytest.raises(CalibrationError, match="cannot load"):
        time_chain([broken], {}, runs=1)


# ------------------------------------------------------------------------------ end to end


def _mm_block(nodes: list[Any], inits: list[Any], h: str, i: int, rng: Any) -> str:
    weight = (rng.standard_normal((WIDTH, WIDTH)) / WIDTH).astype(np.float32)
    inits.append(numpy_helper.from_array(weight, f"A{i}"))
    nodes += [
        helper.make_node("MatMul", [h, f"A{i}"], [f"u{i}"]),
        helper.make_node("Tanh", [f"u{i}"], [f"t{i}"]),
        helper.make_node("Add", [h, f"t{i}"], [f"h{i}"]),
    ]
    return f"h{i}"


def trig_then_matmuls(chain: int = 40, blocks: int = 6, seed: int = 0) -> onnx.ModelProto:
    """``chain`` alternating ``Sin``/``Cos`` (cheap in FLOPs, slow in fact), then MatMul blocks."""
    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    inits: list[Any] = []
    current = "x"
    for j in range(chain):
        nodes.append(helper.make_node("Sin" if j % 2 == 0 else "Cos", [current], [f"s{j}"]))
        current = f"s{j}"
    nodes.append(helper.make_node("Add", ["x", current], ["h"]))
    h = "h"
    for i in range(blocks):
        h = _mm_block(nodes, inits, h, i, rng)
    graph = helper.make_graph(
        nodes,
        "trig_then_matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["batch", WIDTH])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def _trig_units(analysis: Analysis) -> list[int]:
    order, nodes = analysis.frontier.order, analysis.index.nodes
    return [
        k
        for k, u in enumerate(analysis.units.units)
        if any(nodes[n].op_type in ("Sin", "Cos") for n in order[u.start : u.end])
    ]


@pytest.fixture
def trig_model(tmp_path: Path) -> Path:
    path = tmp_path / "trig.onnx"
    onnx.save(trig_then_matmuls(), str(path))
    return path


def test_calibrated_split_prices_the_slow_unit_by_its_measured_time(
    trig_model: Path, tmp_path: Path
) -> None:
    devices = _devices([1.0, 1.0])
    out = tmp_path / "out"
    options = SplitOptions(calibrate=True, calibration_runs=3, dims={"batch": BATCH}, verify=True)
    result = split_model(trig_model, devices, out, options)
    calibration = result.calibration
    assert calibration is not None and result.flop_plan is not None
    analysis = result.analysis
    trig = _trig_units(analysis)
    assert trig and len(trig) < len(analysis.units.units)
    rest = [k for k in range(len(analysis.units.units)) if k not in trig]

    flop_trig = sum(calibration.flop_shares[k] for k in trig)
    measured_trig = sum(calibration.shares[k] for k in trig)
    assert measured_trig > 4 * flop_trig
    assert sum(calibration.shares[k] for k in rest) < sum(calibration.flop_shares[k] for k in rest)

    # the problem's compute follows the measured times exactly
    total = sum(u.flops for u in analysis.units.units)
    for unit, seconds in zip(result.problem.units, calibration.seconds, strict=True):
        assert math.isclose(unit.compute_s["d0"], total / 1e9 * seconds / calibration.total_s)

    # FLOPs put the cut among the MatMuls; measured times put it inside the slow chain
    first_matmul = analysis.units.boundaries[max(trig) + 1]
    cut_flops = result.flop_plan.stages[0].end
    cut_measured = result.plan.stages[0].end
    assert analysis.units.boundaries[cut_flops] > first_matmul
    assert cut_measured <= max(trig) + 1

    manifest = result.manifest
    predicted = sum(s.predicted_compute_s for s in manifest.segments)
    assert math.isclose(predicted, total / 1e9)
    assert result.verification is not None
    assert not [p for p in out.iterdir() if p.name.startswith(".fedshard-calibrate")]


def test_calibration_reads_external_data_and_direct_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("partitioner.analysis.modelio.INLINE_ON_LOAD_BYTES", 0)
    source = tmp_path / "model"
    source.mkdir()
    path = source / "trig.onnx"
    onnx.save(
        trig_then_matmuls(chain=6, blocks=3),
        str(path),
        save_as_external_data=True,
        location="trig.onnx.data",
        size_threshold=0,
    )
    options = SplitOptions(calibrate=True, calibration_runs=1, carry_io=False, verify=True)
    result = split_model(path, _devices([1.0, 1.0]), tmp_path / "out", options)
    assert result.calibration is not None
    assert len(result.calibration.seconds) == len(result.analysis.units.units)
    assert math.isclose(sum(result.calibration.shares), 1.0)


def test_an_infeasible_model_fails_before_any_timing(
    trig_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("timed an infeasible model")

    monkeypatch.setattr(split, "time_chain", refuse)
    with pytest.raises(InfeasiblePlanError):
        split_model(trig_model, _devices([1.0], memory=1000), tmp_path / "o", _calibrated())


def _calibrated() -> SplitOptions:
    return SplitOptions(calibrate=True, calibration_runs=1)


def test_without_calibrate_nothing_is_timed(trig_model: Path, tmp_path: Path) -> None:
    result = split_model(trig_model, _devices([1.0, 2.0]), tmp_path / "o")
    assert result.calibration is None and result.flop_plan is None
    analysis = analyse(onnx.load(str(trig_model)))
    flops = [u.flops / 1e9 for u in analysis.units.units]
    assert [u.compute_s["d0"] for u in result.problem.units] == pytest.approx(flops)


# ------------------------------------------------------------------------------------- CLI


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedshard")
    split_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


def test_cli_calibrate_prints_shares_and_writes_calibrated_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "stack.onnx"
    onnx.save(block_stack(4, width=32), str(model))
    devices = tmp_path / "devices.json"
    devices.write_text(_devices([2.0, 2.0], memory=10**7).to_json())
    out = tmp_path / "out"
    argv = ["split", str(model), "--devices", str(devices), "--out", str(out)]
    code = _run([*argv, "--calibrate", "--calibration-runs", "2"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "FLOP share" in printed and "measured share" in printed
    assert "fastest of 2 runs" in printed and "compute calibrated" in printed
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    flops = sum(u.flops for u in analyse(onnx.load(str(model))).units.units)
    total = sum(s.predicted_compute_s for s in manifest.segments)
    assert math.isclose(total, flops / 2e9)
    with pytest.raises(SystemExit):
        _run([*argv, "--calibrate", "--calibration-runs", "0"])
