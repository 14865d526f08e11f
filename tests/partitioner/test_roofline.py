"""Roofline costs: the device's roofs, units' work, the ``/2`` problem and what it plans.

Unit tests (a fake-free ONNX Runtime for the micro-benchmarks, hand-built graphs for the
traffic); the brute-force equality of the planner on ``/2`` problems is in test_planner.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coordinator.deploy.plan import LiveDevice
from coordinator.deploy.stage_timing import HIGHEST, StageTime, StageTiming, corrected
from edge_agent.config import RuntimeConfig
from edge_agent.profile.membench import (
    cache_level,
    measure_call_us,
    measure_memory_gbps,
    measure_op_us,
    measure_topk_ns,
    parse_cache_size,
    run_spread,
)
from edge_agent.profile.vectorbench import (
    counted_elements,
    measure_vector_gflops,
    vector_model_bytes,
)
from partitioner.analysis.roofline import bound_by, stage_seconds, unit_traffic
from partitioner.cutting.split import analyse, analysis_work
from partitioner.planning.planner import evaluate, plan
from protocols.decoder import TRAILING_POSITIONS
from protocols.errors import SchemaError
from protocols.plan import Objective
from protocols.problem import PlanningProblem, Roofs, Work, roofline_s

SHARED = Path(__file__).resolve().parents[3] / "shared" / "benchmarks" / "planner"


# ----------------------------------------------------------------------------- the roofs


def test_roofline_takes_the_larger_roof_plus_operator_cost() -> None:
    roofs = Roofs(gflops=100.0, memory_gbps=10.0, cache_bytes=1000, cache_gbps=50.0, op_us=2.0)
    decode = Work(flops=2_000_000, bytes_read=4_000_000, ops=10)  # 0.02 ms vs 0.4 ms
    assert roofline_s(decode, roofs) == pytest.approx(4e-4 + 2e-5)
    assert bound_by(decode, roofs) == "memory"
    encode = Work(flops=1_000_000_000, bytes_read=4_000_000)  # 10 ms vs 0.4 ms
    assert roofline_s(encode, roofs) == pytest.approx(1e-2)
    assert bound_by(encode, roofs) == "compute"
    small = Work(flops=0, bytes_read=1000)  # fits the cache: 50 GB/s, not 10
    assert roofline_s(small, roofs) == pytest.approx(1000 / 50e9)
    assert roofline_s(decode, Roofs(gflops=100.0)) == pytest.approx(2e-5)


def test_one_row_4bit_products_are_priced_at_their_own_roof() -> None:
    roofs = Roofs(gflops=100.0, gemv_gflops=10.0)
    step = Work(flops=10**9, bytes_read=0, gemv_flops=8 * 10**8)
    assert roofline_s(step, roofs) == pytest.approx(2e8 / 1e11 + 8e8 / 1e10)
    assert roofline_s(step, Roofs(gflops=100.0)) == pytest.approx(1e-2)  # not measured
    assert roofline_s(Work(flops=10**9, bytes_read=0), roofs) == pytest.approx(1e-2)


def test_4bit_products_add_their_time_to_the_reads_where_other_work_overlaps_them() -> None:
    roofs = Roofs(gflops=100.0, gemv_gflops=10.0, memory_gbps=10.0)
    step = Work(flops=10**8, gemv_flops=10**8, bytes_read=10**8)
    assert roofline_s(step, roofs) == pytest.approx(1e-2 + 1e-2)  # unpacking, then reading
    dense = Work(flops=10**9, bytes_read=10**8)
    assert roofline_s(dense, roofs) == pytest.approx(1e-2)  # the larger of the two


def test_element_wise_kernels_add_their_time_to_the_products_reads() -> None:
    roofs = Roofs(gflops=100.0, vector_gflops=1.0, memory_gbps=10.0)
    layer = Work(flops=10**6 + 10**7, bytes_read=10**8, vector_flops=10**6)
    # the products (0.1 ms of FLOPs) wait on their 10 ms of weights; the 1 ms of element-wise
    # kernels runs before and after them, on the same core
    assert roofline_s(layer, roofs) == pytest.approx(1e-2 + 1e-3)


def test_element_wise_work_is_priced_at_the_vector_roof() -> None:
    roofs = Roofs(gflops=100.0, vector_gflops=1.0)
    block = Work(flops=10**9 + 10**6, bytes_read=0, vector_flops=10**6)
    assert roofline_s(block, roofs) == pytest.approx(1e-2 + 1e-3)
    assert roofline_s(block, Roofs(gflops=100.0)) == pytest.approx((10**9 + 10**6) / 1e11)
    both = Roofs(gflops=100.0, vector_gflops=1.0, gemv_gflops=10.0)
    mixed = Work(flops=10**9, bytes_read=0, gemv_flops=10**9 - 10**6, vector_flops=10**7)
    # the vector part is capped by what the 4-bit products leave
    assert roofline_s(mixed, both) == pytest.approx((10**9 - 10**6) / 1e10 + 10**6 / 1e9)


def test_a_stage_reads_at_cache_speed_only_if_all_its_units_fit_the_cache() -> None:
    roofs = Roofs(gflops=1e6, memory_gbps=10.0, cache_bytes=1000, cache_gbps=50.0, call_us=1.0)
    unit = Work(flops=0, bytes_read=600)
    assert roofline_s(unit, roofs) == pytest.approx(600 / 50e9)  # on its own it fits
    assert roofline_s(unit, roofs, stage_bytes=1200) == pytest.approx(600 / 10e9)
    assert stage_seconds([unit], roofs) == pytest.approx(600 / 50e9 + 1e-6)
    assert stage_seconds([unit, unit], roofs) == pytest.approx(1200 / 10e9 + 1e-6)
    problem = PlanningProblem.from_obj(
        {
            "format": "fedshard.problem/2",
            "units": [
                {"name": f"u{i}", "weight_bytes": 0, "out_bytes": 0, "work": unit.model_dump()}
                for i in range(2)
            ],
            "devices": [
                {"name": "d", "type": "t", "memory_bytes": 10, "bandwidth_mbps": 1.0}
                | roofs.model_dump()
            ],
        }
    )
    [stage] = plan(problem).stages
    assert stage.compute_s == pytest.approx(stage_seconds([unit, unit], roofs))


def test_element_wise_operators_are_counted_apart_from_products_and_views() -> None:
    weight = numpy_helper.from_array(np.ones((8, 16), np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Softmax", ["h"], ["s"], axis=-1),
            helper.make_node("Reshape", ["s", "shape"], ["r"]),
            helper.make_node("Add", ["r", "r"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
        [weight, numpy_helper.from_array(np.array([64], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    work = analysis_work(analyse(model))
    assert sum(w.flops for w in work) == 2 * 4 * 8 * 16 + 64 + 64 + 64
    assert sum(w.vector_flops for w in work) == 64 + 64  # the softmax and the add


def test_the_vector_benchmark_counts_its_elements_as_the_planner_does() -> None:
    model = onnx.load_from_string(vector_model_bytes())
    onnx.checker.check_model(model)
    work = analysis_work(analyse(model))
    assert sum(w.vector_flops for w in work) == counted_elements()
    gflops = measure_vector_gflops(RuntimeConfig(), budget_s=0.1, trials=2)
    print(f"element-wise roof {gflops} G elements/s")
    assert gflops > 0


@pytest.mark.parametrize(("rows", "one_row"), [(1, True), (4, True), (64, False)])
def test_a_4bit_product_counts_as_one_row_work_only_over_a_few_rows(
    rows: int, one_row: bool
) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    weight = numpy_helper.from_array(np.ones((64, 32), np.float32) / 8, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 32])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=False)
    quantizer.process()
    quantized = quantizer.model.model
    assert [n.op_type for n in quantized.graph.node] == ["MatMulNBits"]
    [work] = analysis_work(analyse(quantized, dims={"rows": rows}))
    assert work.flops == 2 * rows * 64 * 32
    assert work.gemv_flops == (work.flops if one_row else 0)


def test_cache_level_is_the_largest_probe_still_faster_than_the_roof() -> None:
    mib = 1 << 20
    # measured here: one slow probe (2 MiB) inside the cache is noise, not its edge
    points = [(mib, 23.8), (2 * mib, 11.5), (4 * mib, 16.5), (8 * mib, 19.1), (16 * mib, 19.3)]
    points += [(32 * mib, 10.2), (64 * mib, 9.4)]
    size, gbps = cache_level(points, roof_gbps=9.3)
    assert size == 16 * mib and gbps == pytest.approx(19.2)
    assert cache_level(points, roof_gbps=30.0) == (0, None)
    assert parse_cache_size("4096K\n") == 4 << 20
    assert parse_cache_size("300M") == 300 << 20
    assert parse_cache_size("512") == 512


def test_memory_roof_is_measured_and_its_spread_is_reported() -> None:
    runs = [measure_memory_gbps(RuntimeConfig(), 64 << 20, trials=3) for _ in range(3)]
    assert min(runs) > 0
    spread = run_spread(runs)
    print(f"memory roof {runs} GB/s, largest deviation from the median {spread:.1%}")
    assert run_spread([9.0, 10.0, 11.0]) == pytest.approx(0.1)
    assert run_spread([4.0, 4.0]) == 0.0
    with pytest.raises(ValueError):
        run_spread([])


def test_fixed_costs_are_measured_in_onnx_runtime() -> None:
    runtime = RuntimeConfig()
    call_us, op_us, topk_ns = (
        measure_call_us(runtime),
        measure_op_us(runtime),
        measure_topk_ns(runtime),
    )
    print(f"call {call_us:.1f} us, operator {op_us:.2f} us, TopK {topk_ns:.2f} ns an element")
    assert call_us > 0 and op_us > 0 and topk_ns > 0
    roofs = Roofs(gflops=100.0, op_us=1.0, call_us=10.0, topk_ns=3.0)
    assert roofline_s(Work(flops=0, bytes_read=0, topk_elements=1000), roofs) == pytest.approx(3e-6)


# ----------------------------------------------------------------------------- unit work


def _embed_and_project() -> onnx.ModelProto:
    """ids -> Gather(E, 100 x 8 float32) -> MatMul(int8 weight, dequantized) -> y."""
    table = numpy_helper.from_array(np.ones((100, 8), np.float32), "E")
    weight = numpy_helper.from_array(np.ones((8, 16), np.int8), "Wq")
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["h"]),
        helper.make_node("DequantizeLinear", ["Wq", "s"], ["W"]),
        helper.make_node("MatMul", ["h", "W"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embed_project",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16])],
        [table, weight, scale],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_units_read_weights_at_stored_precision_and_only_the_rows_they_gather() -> None:
    analysis = analyse(_embed_and_project(), dims={"batch": 1, "seq": 3})
    traffic = unit_traffic(analysis.index, analysis.frontier, analysis.table, analysis.units)
    rows = 3 * 8 * 4  # three gathered rows of the float32 table, not its 3200 bytes
    int8_weight_and_scale = 8 * 16 + 4  # not the 512 bytes of the dequantized float
    assert sum(t.weight_bytes for t in traffic) == rows + int8_weight_and_scale
    ids, y = 3 * 8, 3 * 16 * 4
    boundary = sum(t.activation_bytes for t in traffic)
    assert ids + y <= boundary <= ids + y + 2 * rows  # plus the hidden state between units
    assert sum(t.ops for t in traffic) == 3  # Gather, MatMul and the recomputed dequantize


# ----------------------------------------------------------------------------- the problem


def _document(**device_roofs: object) -> dict[str, object]:
    return {
        "format": "fedshard.problem/2",
        "units": [
            {"name": "u", "weight_bytes": 1, "out_bytes": 1, "work": {"flops": 1, "bytes_read": 1}}
        ],
        "devices": [
            {"name": "a", "type": "t", "memory_bytes": 10, "bandwidth_mbps": 1, **device_roofs}
        ],
    }


def test_problem_2_needs_its_format_roofs_and_agreement_within_a_type() -> None:
    assert PlanningProblem.from_obj(_document(gflops=1.0)).unit_seconds(0, "t") == 1e-9
    old = dict(_document(gflops=1.0), format="fedshard.problem/1")
    with pytest.raises(SchemaError, match="problem/2"):
        PlanningProblem.from_obj(old)
    with pytest.raises(SchemaError, match="neither compute_s nor work"):
        PlanningProblem.from_obj(_document())
    with pytest.raises(SchemaError, match="no gflops"):
        PlanningProblem.from_obj(_document(memory_gbps=1.0))
    twins = _document(gflops=1.0)
    devices = twins["devices"]
    assert isinstance(devices, list)
    devices.append({**devices[0], "name": "b", "gflops": 2.0})
    with pytest.raises(SchemaError, match="different roofs"):
        PlanningProblem.from_obj(twins)


def test_problem_1_files_are_still_read() -> None:
    files = sorted(SHARED.glob("*.json"))
    if not files:
        pytest.skip("no shared PipeEdge problems on this machine")
    for path in files[:3]:
        problem = PlanningProblem.from_obj(json.loads(path.read_text()))
        assert problem.format == "fedshard.problem/1"
        assert plan(problem).stages


def _decode_problem(slow_gbps: float) -> PlanningProblem:
    """Six memory-bound decode units; one roomy fast device and two smaller slower ones."""
    unit = {"weight_bytes": 50, "out_bytes": 8, "work": {"flops": 1000, "bytes_read": 50_000_000}}
    devices = [
        {"name": "big", "memory_bytes": 1000, "gflops": 100.0, "memory_gbps": 20.0},
        {"name": "s1", "memory_bytes": 200, "gflops": 100.0, "memory_gbps": slow_gbps},
        {"name": "s2", "memory_bytes": 200, "gflops": 100.0, "memory_gbps": slow_gbps},
    ]
    return PlanningProblem.from_obj(
        {
            "format": "fedshard.problem/2",
            "units": [dict(unit, name=f"u{i}") for i in range(6)],
            "devices": [dict(d, type=str(d["name"]), bandwidth_mbps=100.0) for d in devices],
        }
    )


def _best_single(problem: PlanningProblem, objective: Objective) -> float:
    n = len(problem.units)
    scores = [evaluate(problem, objective, [(d.name, 0, n)]) for d in problem.devices]
    fits = [s for s in scores if all(st.memory_bytes <= 1000 for st in s.stages)]
    return min(s.bottleneck_s if objective is Objective.THROUGHPUT else s.latency_s for s in fits)


@pytest.mark.parametrize("objective", list(Objective))
def test_one_device_plan_is_chosen_when_it_is_the_best(objective: Objective) -> None:
    problem = _decode_problem(slow_gbps=2.0)  # a slow device's two units take 50 ms
    chosen = plan(problem, objective)
    assert [(s.device, s.start, s.end) for s in chosen.stages] == [("big", 0, 6)]
    assert chosen.bottleneck_s == _best_single(problem, Objective.THROUGHPUT)


def test_sharding_is_chosen_only_when_it_beats_the_best_single_device() -> None:
    problem = _decode_problem(slow_gbps=15.0)  # now the small devices take a real share
    chosen = plan(problem, Objective.THROUGHPUT)
    assert len(chosen.stages) > 1
    assert chosen.bottleneck_s < _best_single(problem, Objective.THROUGHPUT)


def test_a_sharded_plan_must_beat_the_best_one_device_plan_by_the_margin() -> None:
    from partitioner.planning.planner import ONE_DEVICE_MARGIN, plan_preferring_one_device

    kept = {"one device over a slightly better shard": 0, "shard": 0}
    for tenth in range(20, 200, 2):  # the small devices from 2 to 20 GB/s
        problem = _decode_problem(slow_gbps=tenth / 10)
        exact = plan(problem, Objective.THROUGHPUT)
        single = _best_single(problem, Objective.THROUGHPUT)
        chosen = plan_preferring_one_device(problem, Objective.THROUGHPUT)
        if single <= (1 + ONE_DEVICE_MARGIN) * exact.bottleneck_s:
            assert [(s.device, s.start, s.end) for s in chosen.stages] == [("big", 0, 6)]
            assert chosen.bottleneck_s == single
            if len(exact.stages) > 1:
                kept["one device over a slightly better shard"] += 1
        else:
            assert chosen == exact and len(chosen.stages) > 1
            kept["shard"] += 1
        fastest = plan(problem, Objective.LATENCY).latency_s
        latency = plan_preferring_one_device(problem, Objective.LATENCY).latency_s
        assert fastest <= latency <= (1 + ONE_DEVICE_MARGIN) * fastest
    assert all(kept.values()), kept  # the sweep has both sides of the margin


# ----------------------------------------------------------------------------- calibration


def _live(name: str) -> LiveDevice:
    return LiveDevice(
        name=name,
        budget_bytes=1,
        committed_bytes=0,
        gflops=100.0,
        host="127.0.0.1",
        control_port=1,
        data_port=2,
        memory_gbps=10.0,
        cache_gbps=40.0,
        op_us=1.0,
    )


def test_corrections_learn_measured_over_predicted_and_scale_every_roof(tmp_path: Path) -> None:
    timing = StageTiming(tmp_path)
    assert timing.factor("a") == 1.0
    timing.record([StageTime("a", predicted_s=0.010, measured_s=0.020)], {})
    assert timing.factor("a") == pytest.approx(2.0)
    slowed = corrected(_live("a"), 2.0)
    assert (slowed.gflops, slowed.memory_gbps, slowed.cache_gbps, slowed.op_us) == (
        50.0,
        5.0,
        20.0,
        2.0,
    )
    work = Work(flops=10**6, bytes_read=10**7, ops=5)
    before = roofline_s(work, Roofs(gflops=100.0, memory_gbps=10.0, op_us=1.0))
    after = roofline_s(work, Roofs(gflops=50.0, memory_gbps=5.0, op_us=2.0))
    assert after == pytest.approx(2 * before)
    # the next deploy was planned with the correction: 2 x uncorrected 10 ms predicted, and
    # measured 18 ms; the ratios kept are against the uncorrected prediction (2.0 and 1.8)
    timing.record([StageTime("a", predicted_s=0.020, measured_s=0.018)], {"a": 2.0})
    assert timing.factor("a") == pytest.approx((2.0 * 1.8) ** 0.5)
    assert StageTiming(tmp_path).factor("a") == timing.factor("a")  # persisted


def test_corrections_are_clamped_and_ignore_timer_noise(tmp_path: Path) -> None:
    timing = StageTiming(None)
    timing.record([StageTime("a", predicted_s=1e-6, measured_s=1.0)], {})
    assert timing.factor("a") == HIGHEST
    timing.record([StageTime("b", predicted_s=0.01, measured_s=1e-7)], {})
    assert timing.factor("b") == 1.0
    assert timing.apply([_live("b")]) == [_live("b")]


def test_a_prefill_prices_the_element_wise_work_of_its_whole_prompt(tiny_llama_dir: Path) -> None:
    from partitioner.analysis.modelio import load_model
    from partitioner.analysis.phases import PREFILL_TOKENS
    from partitioner.cutting.split import analysis_prefill

    analysis = analyse(load_model(tiny_llama_dir / "model.onnx"))
    decode = analysis_work(analysis)
    prefill = analysis_prefill(analysis)
    assert prefill is not None and len(prefill) == len(decode)
    assert all(p.vector_flops <= p.flops and p.gemv_flops <= p.flops for p in prefill)
    # every unit with element-wise work does it for each of the prompt's tokens: not capped at
    # the decode step's FLOPs (which held the attention units at 4.5x too few); only the output
    # head's (at most its two last units) runs on the trailing positions alone, at most
    # TRAILING_POSITIONS rows (and its products on at least two: rowwise.at_least_two_rows)
    pairs = zip(prefill, decode, strict=True)
    growth = [p.vector_flops / d.vector_flops for p, d in pairs if d.vector_flops]
    print(f"prefill/decode element-wise FLOPs per unit: {[round(g, 1) for g in growth]}")
    body = [g for g in growth if g > TRAILING_POSITIONS]
    assert len(body) >= len(growth) - 2 and min(body) >= PREFILL_TOKENS / 2
