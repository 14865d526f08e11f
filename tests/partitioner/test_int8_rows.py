"""int8 activations quantized per row (:mod:`partitioner.models.decoders.int8rows`), on one product.

A weight product quantized by ONNX Runtime's own ``quantize_dynamic``, then rewritten: each row
of a pass computes the same bits as that row alone, and the values are what quantizing that
row alone gives (a numpy reference of ``DynamicQuantizeLinear``'s definition over one row).
Without the rewrite one scale covers the pass, and a row's result changes with its neighbours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.errors import GraphError
from partitioner.models.decoders.int8rows import per_row_activations
from partitioner.models.decoders.ort_quantizers import dynamic_int8

K, N = 48, 24


def _product(weight: np.ndarray, opset: int) -> onnx.ModelProto:
    """``y = x @ weight`` for ``x`` of shape (1, rows, K), weight an initializer."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="product")],
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "rows", N])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    return np.asarray(y)


def _rows() -> np.ndarray:
    """Three rows of very different ranges (a shared scale would round the small one coarsely)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    x[0, 1] *= 40.0
    x[0, 2] = np.abs(x[0, 2]) * 0.05  # all positive: its zero point is 0
    return x


def _reference(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    """Each row quantized alone as ``DynamicQuantizeLinear`` defines it, times the stored
    int8 weight and its scales, in float64."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    (weight,) = [v for v in inits.values() if v.dtype == np.int8 and v.ndim == 2]
    (w_scale,) = [v for k, v in inits.items() if k.endswith("_scale") and v.size == N]
    rows = []
    for row in x[0].astype(np.float64):
        low, high = min(row.min(), 0.0), max(row.max(), 0.0)
        scale = np.float32((high - low) / 255.0)
        zero = np.clip(np.round(-low / scale), 0, 255)
        q = np.clip(np.round(row / scale) + zero, 0, 255)
        rows.append(((q - zero) @ weight.astype(np.float64)) * scale * w_scale)
    return np.array(rows)[None]


@pytest.mark.parametrize("opset", [17, 18])
def test_each_row_of_a_pass_computes_what_it_computes_alone(opset: int) -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    per_pass = dynamic_int8(_product(weight, opset))
    per_row = per_row_activations(dynamic_int8(_product(weight, opset)))
    assert not [n for n in per_row.graph.node if n.op_type == "DynamicQuantizeLinear"]
    x = _rows()
    together = _run(per_row, x)
    for i in range(x.shape[1]):
        assert np.array_equal(_run(per_row, x[:, i : i + 1]), together[:, i : i + 1])
    np.testing.assert_allclose(together, _reference(x, per_row), rtol=1e-5, atol=1e-4)
    exact = x @ weight
    assert np.abs(together - exact).max() < 0.02 * np.abs(exact).max()
    # the pass-wide scale: the small row's result depends on the large row beside it
    shared = _run(per_pass, x)
    assert not np.array_equal(_run(per_pass, x[:, 2:3]), shared[:, 2:3])
    assert np.abs(shared - exact)[:, 2:3].max() > 4 * np.abs(together - exact)[:, 2:3].max()


def test_a_weight_that_is_not_stored_in_the_graph_is_refused(tmp_path: Path) -> None:
    """A ``MatMulInteger`` whose weight is computed (no column sums at export) is a
    :class:`GraphError` naming the node, not a graph that computes something else."""
    model = dynamic_int8(_product(np.ones((K, N), np.float32), 17))
    (product,) = [n for n in model.graph.node if n.op_type == "MatMulInteger"]
    weight = product.input[1]
    stored = next(t for t in model.graph.initializer if t.name == weight)
    model.graph.initializer.remove(stored)
    model.graph.input.append(helper.make_tensor_value_info(weight, TensorProto.INT8, [K, N]))
    with pytest.raises(GraphError, match="not an initializer"):
        per_row_activations(model)


def test_a_graph_without_dynamic_quantization_is_returned_unchanged() -> None:
    model = _product(np.ones((K, N), np.float32), 17)
    before = model.SerializeToString()
    assert per_row_activations(model).SerializeToString() == before
