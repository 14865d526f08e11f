"""Graph analysis on hand-built graphs: static nodes, frontiers, segments, chain equality."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from graph_helpers import (
    HIDDEN,
    OPSET,
    VOCAB,
    chain_outputs,
    kitchen_feeds,
    kitchen_sink,
    kv_feeds,
    kv_stack,
    main_position,
    whole_outputs,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from partitioner.analysis.frontier import build_frontier
from partitioner.analysis.graph import index_graph
from partitioner.cutting.segments import plan_segments
from partitioner.cutting.split import analyse
from partitioner.errors import GraphError


def test_static_nodes_are_constants_shapes_and_weight_only_work() -> None:
    model = kitchen_sink()
    index = index_graph(model.graph)
    static_ops = sorted(index.nodes[i].op_type for i in index.static)
    assert static_ops == ["Constant", "Shape", "Transpose"]
    assert dict(index.leaf_anchor) == {"shape0": "h0"}
    assert set(index.inputs) == {"ids", "bias"}


def test_frontier_holds_residual_late_input_early_output_and_shape_leaf() -> None:
    analysis = analyse(kitchen_sink())
    frontier = analysis.frontier
    after_block1 = main_position(analysis, "h2") + 1
    crossing = set(frontier.crossing(after_block1))
    assert "h2" in crossing  # residual stream
    assert "bias" in crossing  # model input used only at the end
    # the early output (or, if the order moved its Identity to the end, its source) is carried
    assert "early" in crossing or "h1" in crossing
    assert "shape0" in crossing  # shape leaf: its activation h0 is long gone
    assert not crossing & {"c", "ET", "E", "h0"}  # constants and weights are never handed off


def test_direct_io_feeds_inputs_directly_and_emits_outputs_where_made() -> None:
    analysis = analyse(kitchen_sink(), carry_io=False)
    frontier = build_frontier(analysis.index, analysis.table, carry_io=False, alap=False)
    cut = main_position(analysis, "h2", frontier) + 1
    crossing = set(frontier.crossing(cut))
    assert "h2" in crossing and "shape0" in crossing
    assert "bias" not in crossing and "early" not in crossing
    specs = plan_segments(analysis.index, frontier, [0, cut, frontier.size])
    assert "early" in specs[0].outputs
    assert "bias" in specs[1].inputs and "bias" not in specs[0].inputs


def test_constants_are_duplicated_into_every_segment_that_uses_them() -> None:
    analysis = analyse(kitchen_sink())
    size = analysis.frontier.size
    cuts = [0, size // 3, 2 * size // 3, size]
    specs = plan_segments(analysis.index, analysis.frontier, cuts)
    for spec in specs:
        assert "c" not in spec.inputs and "c" not in spec.outputs
    users = [s for s in specs if any(analysis.index.nodes[n].op_type == "Mul" for n in s.nodes)]
    assert len(users) >= 2
    for spec in users:
        ops = [analysis.index.nodes[n].op_type for n in spec.nodes]
        assert "Constant" in ops


def test_tied_initializer_is_shared_and_carried_by_both_ends() -> None:
    analysis = analyse(kitchen_sink())
    shared = {s.name: s for s in analysis.units.shared}
    assert set(shared) == {"E"}
    units = analysis.units.units
    assert shared["E"].units == (0, len(units) - 1)
    assert shared["E"].nbytes == VOCAB * HIDDEN * 4
    assert all(u.weight_bytes < VOCAB * HIDDEN * 4 for u in units)
    size = analysis.frontier.size
    specs = plan_segments(analysis.index, analysis.frontier, [0, size // 2, size])
    assert all("E" in s.initializers for s in specs)


@pytest.mark.parametrize("carry_io", [True, False])
def test_every_two_way_cut_reproduces_the_model(tmp_path: Path, carry_io: bool) -> None:
    model = kitchen_sink(blocks=2)
    feeds = kitchen_feeds()
    expected = whole_outputs(model, tmp_path / "whole.onnx", feeds)
    analysis = analyse(model, carry_io=carry_io)
    size = analysis.frontier.size
    for cut in range(1, size):
        got = chain_outputs(analysis, [0, cut, size], tmp_path / f"cut{cut}", feeds)
        for name, want in expected.items():
            np.testing.assert_array_equal(got[name], want, err_msg=f"cut {cut}: {name}")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_multi_way_cuts_reproduce_the_model(tmp_path: Path, data: st.DataObject) -> None:
    model = kitchen_sink(blocks=3)
    feeds = kitchen_feeds(n=3)
    carry_io = data.draw(st.booleans())
    analysis = analyse(model, carry_io=carry_io)
    size = analysis.frontier.size
    inner = data.draw(st.sets(st.integers(1, size - 1), min_size=1, max_size=5))
    cuts = [0, *sorted(inner), size]
    run_dir = tmp_path / ("-".join(map(str, cuts)) + str(carry_io))
    expected = whole_outputs(model, tmp_path / "whole.onnx", feeds)
    got = chain_outputs(analysis, cuts, run_dir, feeds)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want)


def test_unsorted_graph_is_sorted_and_dead_nodes_dropped(tmp_path: Path) -> None:
    model = kitchen_sink(blocks=2)
    nodes = list(model.graph.node)
    nodes.append(helper.make_node("Neg", ["h1"], ["unused"]))
    reordered = list(reversed(nodes))
    del model.graph.node[:]
    model.graph.node.extend(reordered)
    index = index_graph(model.graph)
    assert "unused" not in index.producer
    produced: set[str] = set(index.inputs) | set(index.initializers)
    for i, node in enumerate(index.nodes):
        assert set(index.node_inputs[i]) <= produced
        produced.update(node.output)
    feeds = kitchen_feeds()
    analysis = analyse(model)
    size = analysis.frontier.size
    got = chain_outputs(analysis, [0, size // 2, size], tmp_path / "seg", feeds)
    want = whole_outputs(kitchen_sink(blocks=2), tmp_path / "whole.onnx", feeds)
    np.testing.assert_array_equal(got["logits"], want["logits"])


def test_cycles_and_undefined_tensors_are_graph_errors() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    cyclic = helper.make_graph(
        [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
        "cyclic",
        [x],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
    )
    with pytest.raises(GraphError, match="cycle"):
        index_graph(cyclic)
    dangling = helper.make_graph([helper.make_node("Relu", ["nope"], ["y"])], "d", [x], [y])
    with pytest.raises(GraphError, match="nothing defines"):
        index_graph(dangling)


def test_if_node_reading_outer_scope_keeps_that_tensor_alive(tmp_path: Path) -> None:
    """A subgraph's outer-scope reads count as uses for frontiers and segment inputs."""
    f32 = TensorProto.FLOAT
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["early_act", "late_act"], ["branch_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("branch_out", f32, [4])],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Sub", ["early_act", "late_act"], ["branch_out2"])],
        "else",
        [],
        [helper.make_tensor_value_info("branch_out2", f32, [4])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["early_act"]),
        helper.make_node("Neg", ["x"], ["n1"]),
        helper.make_node("Exp", ["n1"], ["n2"]),
        helper.make_node("Sigmoid", ["n2"], ["late_act"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph),
    ]
    graph = helper.make_graph(
        nodes,
        "with_if",
        [
            helper.make_tensor_value_info("x", f32, [4]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", f32, [4])],
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    analysis = analyse(model)
    index, frontier = analysis.index, analysis.frontier
    if_node = next(i for i, n in enumerate(index.nodes) if n.op_type == "If")
    assert "early_act" in index.node_inputs[if_node]
    size = frontier.size
    for cut in range(1, size):
        crossing = frontier.crossing(cut)
        assert "early_act" in crossing or frontier.position[index.producer["early_act"]] >= cut
    for flag in (True, False):
        feeds = {"x": np.array([-1, 0.5, 2, -3], np.float32), "cond": np.array(flag)}
        want = whole_outputs(model, tmp_path / "whole.onnx", feeds)
        for cut in range(1, size):
            got = chain_outputs(analysis, [0, cut, size], tmp_path / f"c{cut}{flag}", feeds)
            np.testing.assert_allclose(got["y"], want["y"], rtol=0, atol=0)


def test_alap_order_is_topological_and_not_worse_than_file_order() -> None:
    analysis = analyse(kitchen_sink())
    index, table = analysis.index, analysis.table
    chosen = build_frontier(index, table)
    file_order = build_frontier(index, table, alap=False)
    late = build_frontier(index, table, alap=True)
    assert sum(chosen.bytes_at) == min(sum(file_order.bytes_at), sum(late.bytes_at))
    for frontier in (file_order, late):
        seen: set[int] = set()
        for node in frontier.order:
            for name in index.node_inputs[node]:
                producer = index.producer.get(name)
                if producer is not None and producer not in index.static:
                    assert producer in seen
            seen.add(node)


def test_cut_validation() -> None:
    analysis = analyse(kitchen_sink())
    size = analysis.frontier.size
    for bad in ([0, 0, size], [1, size], [0, size - 1], [0, 3, 2, size]):
        with pytest.raises(GraphError):
            plan_segments(analysis.index, analysis.frontier, bad)
    assert len(plan_segments(analysis.index, analysis.frontier, [0, size])) == 1


def test_frontier_bytes_match_crossing_sizes() -> None:
    analysis = analyse(kitchen_sink(), dims={"n": 6})
    frontier, table = analysis.frontier, analysis.table
    for cut in range(frontier.size + 1):
        expected = sum(table.nbytes(name) for name in frontier.crossing(cut))
        assert frontier.bytes_at[cut] == expected
    assert table.dims_of("logits") == (6, VOCAB)


def test_direct_io_keeps_each_layers_cache_on_its_own_segment(tmp_path: Path) -> None:
    """With ``carry_io=False`` only the hidden state crosses; caches stay where they are used."""
    model = kv_stack(layers=4)
    feeds = kv_feeds(layers=4)
    expected = whole_outputs(model, tmp_path / "whole.onnx", feeds)
    direct = analyse(model, carry_io=False, samples=feeds)
    carried = analyse(model, carry_io=True, samples=feeds)
    for k in range(1, 4):
        cut = main_position(direct, f"h{k}") + 1
        assert direct.frontier.crossing(cut) == (f"h{k}",)
        crossing = set(carried.frontier.crossing(main_position(carried, f"h{k}") + 1))
        assert {f"past{k}", f"present{k - 1}"} <= crossing  # carried along the chain
    size = direct.frontier.size
    cuts = [0, *(main_position(direct, f"h{k}") + 1 for k in (1, 3)), size]
    specs = plan_segments(direct.index, direct.frontier, cuts)
    assert set(specs[1].inputs) == {"h1", "past1", "past2"}
    assert set(specs[1].outputs) == {"h3", "present1", "present2"}
    for analysis, name in ((direct, "direct"), (carried, "carried")):
        got = chain_outputs(analysis, cuts, tmp_path / name, feeds)
        for out, want in expected.items():
            np.testing.assert_array_equal(got[out], want)
