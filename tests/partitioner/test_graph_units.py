"""Shapes at a sample binding, FLOPs, unit grouping and the planning problem built from units."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from graph_helpers import OPSET, block_stack, kitchen_sink
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from partitioner.analysis.costs import node_flops
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import index_graph
from partitioner.analysis.samples import decode_samples, encode_samples, synthesize
from partitioner.analysis.shapes import infer_shapes
from partitioner.analysis.units import _window_min, choose_boundaries
from partitioner.cutting.split import analyse
from partitioner.planning.problem_from_graph import build_problem
from protocols.devices import DeviceList


def _model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, inits: list
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=OPSET)


def test_shape_arithmetic_is_evaluated_at_the_binding() -> None:
    """Range over a Shape, Slice by a Shape and Reshape to a computed target all get sizes."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    table = numpy_helper.from_array(np.arange(64, dtype=np.int64).reshape(1, 64), "positions")
    nodes = [
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Gather", ["sx", "one"], ["seq"], axis=0),
        helper.make_node("Range", ["zero", "seq", "one"], ["r"]),
        helper.make_node("Unsqueeze", ["seq", "axis0"], ["seq1"]),
        helper.make_node("Slice", ["positions", "zero1", "seq1", "one1"], ["pos"]),
        helper.make_node("Concat", ["minus1", "seq1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("NonZero", ["x"], ["nz"]),
    ]
    inits = [
        table,
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([0], np.int64), "zero1"),
        numpy_helper.from_array(np.array([1], np.int64), "one1"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    outs = [
        helper.make_tensor_value_info(n, f32 if n == "y" else i64, None)
        for n in ("r", "pos", "y", "nz")
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", f32, ["b", "s"])], outs, inits)
    index = index_graph(model.graph)
    shapes = infer_shapes(model, index, {"b": 3, "s": 7})
    assert shapes.dims_of("r") == (7,)
    assert shapes.dims_of("pos") == (1, 7)
    assert shapes.dims_of("y") == (3, 7)
    assert "nz" in shapes.estimated  # data-dependent: sized by a guess, and said so
    assert dict(shapes.dims) == {"b": 3, "s": 7}


def test_flops_of_matmul_gemm_conv_and_elementwise() -> None:
    f32 = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "G"),
        numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "K"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Gemm", ["x", "G"], ["gm"], transB=1),
        helper.make_node("Conv", ["img", "K"], ["cv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["mm"], ["out"]),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", f32, [3, 8]),
            helper.make_tensor_value_info("img", f32, [1, 2, 5, 5]),
        ],
        [helper.make_tensor_value_info(n, f32, None) for n in ("out", "gm", "cv")],
        inits,
    )
    index = index_graph(model.graph)
    table = infer_shapes(model, index, {})
    flops = {
        n.output[0]: node_flops(n, index.node_inputs[i], table) for i, n in enumerate(index.nodes)
    }
    assert flops["mm"] == 2 * 3 * 5 * 8
    assert flops["gm"] == 2 * 3 * 6 * 8 + 3 * 6
    assert flops["cv"] == 2 * (1 * 4 * 5 * 5) * (2 * 3 * 3)
    assert flops["out"] == 3 * 5


def test_units_of_a_block_stack_start_at_block_boundaries() -> None:
    blocks = 12
    analysis = analyse(block_stack(blocks), dims={"batch": 2})
    frontier, plan = analysis.frontier, analysis.units
    smallest = min(frontier.bytes_at[1:-1])
    assert 8 <= len(plan.units) <= blocks
    for cut in plan.boundaries[1:-1]:
        assert frontier.bytes_at[cut] == smallest
        assert frontier.crossing(cut)[0].startswith("x")
    assert sum(u.flops for u in plan.units) > 0
    assert sum(u.weight_bytes for u in plan.units) == blocks * 2 * 64 * 128 * 4
    assert all(u.out_bytes == frontier.bytes_at[u.end] for u in plan.units)
    assert all(u.workspace_bytes >= u.out_bytes for u in plan.units[:-1])


@pytest.mark.parametrize("max_units", [1, 2, 3, 5])
def test_max_units_is_respected(max_units: int) -> None:
    analysis = analyse(block_stack(10), max_units=max_units)
    assert len(analysis.units.units) <= max_units
    bounds = analysis.units.boundaries
    assert bounds[0] == 0 and bounds[-1] == analysis.frontier.size
    assert list(bounds) == sorted(set(bounds))


def _funnel(widths: list[int]) -> onnx.ModelProto:
    """MatMuls that shrink the activation at every step: the frontier only ever falls."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        inits.append(
            numpy_helper.from_array(rng.standard_normal((a, b)).astype(np.float32), f"W{i}")
        )
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"W{i}"], [f"x{i + 1}"]))
    f32 = TensorProto.FLOAT
    return _model(
        nodes,
        [helper.make_tensor_value_info("x0", f32, [1, widths[0]])],
        [helper.make_tensor_value_info(f"x{len(widths) - 1}", f32, None)],
        inits,
    )


def test_oversized_units_are_split_even_without_good_cuts() -> None:
    """A frontier that only falls has no local minima, yet units stay fine-grained."""
    analysis = analyse(_funnel(list(range(160, 0, -8))))
    frontier = analysis.frontier
    assert all(a > b for a, b in zip(frontier.bytes_at[1:], frontier.bytes_at[2:], strict=False))
    assert len(analysis.units.units) >= 8
    bounds = choose_boundaries(frontier, [1.0] * frontier.size, max_units=64, min_units=4)
    assert len(bounds) - 1 >= 4


def test_a_dominant_nodes_split_keeps_the_free_nodes_before_it_on_its_side() -> None:
    """A head ``MatMul`` preceded by its row padding (a ``Concat`` and a ``Slice``, free, whose
    output has twice the rows): the unit is cut before the padding, where one row crosses, not
    between the padding and the product, where two would (a decode step's hop)."""
    costs = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 100.0, 0.0]
    one_row, two_rows = 10, 20
    bytes_at = (0, one_row, one_row, one_row, one_row, two_rows, two_rows, 500, 0)
    frontier = Frontier(
        order=tuple(range(8)),
        position={i: i for i in range(8)},
        spans={},
        bytes_at=bytes_at,
        carry_io=False,
    )
    bounds = choose_boundaries(frontier, costs, max_units=64, min_units=4)
    assert 4 in bounds
    assert 5 not in bounds and 6 not in bounds, bounds


def test_problem_from_units_and_devices() -> None:
    analysis = analyse(kitchen_sink())
    devices = DeviceList.from_obj(
        {
            "devices": [
                {"name": "a", "memory_bytes": 10**6, "gflops": 2.0, "bandwidth_mbps": 100},
                {"name": "b", "memory_bytes": 10**6, "gflops": 4.0, "bandwidth_mbps": 50},
            ],
            "links": [{"a": "a", "b": "b", "bandwidth_mbps": 80, "latency_ms": 1.5}],
        }
    )
    problem = build_problem(analysis.units, devices, queue_depth=3, name="ks")
    assert [d.type for d in problem.devices] == ["a", "b"]
    assert problem.queue_depth == 3 and problem.input_bytes == analysis.units.input_bytes
    for unit, graph_unit in zip(problem.units, analysis.units.units, strict=True):
        assert unit.compute_s["a"] == pytest.approx(graph_unit.flops / 2e9)
        assert unit.compute_s["b"] == pytest.approx(graph_unit.flops / 4e9)
        assert unit.out_bytes == graph_unit.out_bytes
    assert problem.links[0].latency_ms == 1.5
    assert [s.name for s in problem.shared_weights] == ["E"]


def test_samples_round_trip_and_synthesised_indices_are_in_range() -> None:
    analysis = analyse(kitchen_sink(), dims={"n": 9})
    samples = synthesize(analysis.index, analysis.table)
    assert samples["ids"].shape == (9,) and samples["ids"].dtype == np.int64
    assert samples["ids"].min() >= 0 and samples["ids"].max() < 200
    assert samples["bias"].dtype == np.float32
    back = decode_samples(encode_samples(samples))
    for name, array in samples.items():
        np.testing.assert_array_equal(back[name], array)
        assert back[name].dtype == array.dtype


def test_long_stacks_are_grouped_into_balanced_units() -> None:
    analysis = analyse(block_stack(300, width=16), max_units=32)
    units = analysis.units.units
    assert len(units) == 32
    flops = [u.flops for u in units]
    assert max(flops) <= 2 * min(flops)
    smallest = min(analysis.frontier.bytes_at[1:-1])
    assert all(analysis.frontier.bytes_at[b] == smallest for b in analysis.units.boundaries[1:-1])


@given(values=st.lists(st.integers(0, 50), min_size=1, max_size=40), half=st.integers(1, 10))
def test_window_minimum_matches_the_definition(values: list[int], half: int) -> None:
    expected = [min(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]
    assert _window_min(values, half) == expected
