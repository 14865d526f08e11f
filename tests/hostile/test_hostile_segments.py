"""Hostile segments: correctly signed ONNX files whose declared shapes would exhaust memory.

Each is refused before ONNX Runtime parses it (nothing is written to the segment directory),
with a BudgetError naming the tensor; the store then still deploys a good segment. Tampered
bytes and forged signatures are covered by ``test_agent_units`` and ``test_agent_process``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from agent_fakes import CHAIN, segment_store
from agent_helpers import TestCA, manifest_for, tiny_chain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from edge_agent.errors import BudgetError, SegmentLoadError
from edge_agent.protobuf.limits import check_declared_sizes

HUGE = [1 << 20, 1 << 20]
WIDTH = 8


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    x_shape: list[int | str] | None = None,
) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape or ["batch", WIDTH])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "hostile", [x], [h], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _lying_initializer() -> bytes:
    """An initializer declared as 4 TiB of floats that carries 16 bytes."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=HUGE, raw_data=bytes(16))
    return _model([helper.make_node("MatMul", ["x", "w"], ["h"])], [w])


def _huge_input() -> bytes:
    return _model([helper.make_node("Relu", ["x"], ["h"])], [], x_shape=HUGE)


def _expand_to_huge() -> bytes:
    shape = numpy_helper.from_array(np.array(HUGE, np.int64), "shape")
    return _model([helper.make_node("Expand", ["x", "shape"], ["h"])], [shape])


def _constant_of_huge_shape() -> bytes:
    value = helper.make_tensor("v", TensorProto.INT64, [2], HUGE)
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=value),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Add", ["x", "zeros"], ["h"]),
    ]
    return _model(nodes, [])


def _reshape_to_huge() -> bytes:
    shape = numpy_helper.from_array(np.array([1 << 40, 1 << 20], np.int64), "shape")
    return _model([helper.make_node("Reshape", ["x", "shape"], ["h"])], [shape])


def _huge_constant() -> bytes:
    value = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=HUGE, raw_data=bytes(4))
    nodes = [
        helper.make_node("Constant", [], ["c"], value=value),
        helper.make_node("Add", ["x", "c"], ["h"]),
    ]
    return _model(nodes, [])


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (_lying_initializer, "tensor 'w'"),
        (_huge_input, "value 'x'"),
        (_expand_to_huge, "Expand to"),
        (_constant_of_huge_shape, "ConstantOfShape to"),
        (_reshape_to_huge, "Reshape to"),
        (_huge_constant, "tensor 'c'"),
    ],
)
def test_declared_shapes_over_the_budget_are_refused_before_loading(
    tmp_path: Path, build: object, named: str
) -> None:
    ca = TestCA(tmp_path)
    store = segment_store(ca)
    segment = build()  # type: ignore[operator]
    with pytest.raises(BudgetError, match="refused before loading") as refused:
        store.deploy(ca.sign(manifest_for(0, segment, CHAIN)), segment)
    assert named in str(refused.value)
    assert not list((ca.directory / "segments-a0").glob("*.onnx"))  # never written, never parsed
    good = tiny_chain()[0]
    assert store.deploy(ca.sign(manifest_for(0, good, CHAIN)), good).report.warmup_s > 0


def test_huge_warmup_shapes_are_refused_before_loading(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    store = segment_store(ca)
    seg = tiny_chain()[0]
    manifest = manifest_for(0, seg, CHAIN, warmup_shapes={"x": [1 << 30, WIDTH]})
    with pytest.raises(BudgetError, match="warm-up input 'x'"):
        store.deploy(ca.sign(manifest), seg)
    assert store.deploy(ca.sign(manifest_for(0, seg, CHAIN)), seg).report.warmup_s > 0


def test_real_segments_pass_the_declared_size_check() -> None:
    for segment in tiny_chain():
        check_declared_sizes(segment, 1 << 20, {"x": [4, WIDTH]})
    with pytest.raises(BudgetError):  # w0 alone is 8 x 8 floats
        check_declared_sizes(tiny_chain()[0], 255, {})


SEED = tiny_chain()[0]


@given(
    st.lists(st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), max_size=8)
    | st.binary(max_size=300).map(lambda b: [(-1, b)])
)
@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
def test_the_protobuf_reader_raises_only_deploy_errors(edits: list[tuple[int, object]]) -> None:
    data = bytearray(SEED)
    for pos, value in edits:
        if pos < 0 and isinstance(value, bytes):
            data = bytearray(value)
        elif isinstance(value, int):
            data[pos] = value
    with contextlib.suppress(BudgetError, SegmentLoadError):
        check_declared_sizes(bytes(data), 64 << 20, {})
