"""Units of LoRA over quantized weights: dequantize, map, and merge across segments."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from partitioner.errors import GraphError
from partitioner.models.decoders.precision import quantize_model
from partitioner.models.lora import merged_by_segment, weight_map
from partitioner.models.lora_quant import dequantized, quantized_weights

K, N = 64, 32


def _quantized(weights: str) -> tuple[onnx.ModelProto, np.ndarray]:
    """``y = x @ W.T`` as a float graph (torch layout ``W [N, K]``), stored in ``weights``."""
    w = np.random.default_rng(0).normal(0, 0.1, (N, K)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, N])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return quantize_model(model, weights), w  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_map_finds_the_quantized_weight_by_value(weights: str) -> None:
    model, w = _quantized(weights)
    wmap = weight_map({"m.weight": w}, model)
    (ref,) = wmap["m.weight"]
    assert ref.transpose and ref.quantized is not None and ref.quantized.shape == [K, N]
    inits = {t.name: t for t in model.graph.initializer}
    step = float(np.max(numpy_helper.to_array(inits[ref.quantized.scale])))
    assert np.abs(dequantized(ref.quantized, ref.initializer, inits) - w.T).max() <= step
    with pytest.raises(GraphError, match=r"other\.weight"):  # another weight of the same shape
        weight_map({"other.weight": w[::-1].copy()}, model)


def test_a_merge_writes_the_scale_to_the_segment_that_holds_it() -> None:
    """The scale may sit in a later segment than the data; each goes where it is."""
    model, w = _quantized("int8")
    data = next(iter(quantized_weights(model)))
    ref = quantized_weights(model)[data]
    first, second = onnx.ModelProto(), onnx.ModelProto()
    for tensor in model.graph.initializer:
        (second if tensor.name == ref.scale else first).graph.initializer.append(tensor)
    wmap = weight_map({"m.weight": w}, model)
    a = np.full((2, K), 0.2, np.float32)  # moves the weight by 0.16: 7-bit steps are ~0.005
    b = np.full((N, 2), 0.2, np.float32)
    merged = merged_by_segment([first, second], {"m": (a, b)}, wmap, 2.0)
    assert set(merged) == {0, 1}
    assert ref.scale in merged[1] and data in merged[0] and ref.scale not in merged[0]
    index = {t.name: t for t in model.graph.initializer}
    after = {**index, **{k: numpy_helper.from_array(v, k) for m in merged.values()
                         for k, v in m.items()}}  # fmt: skip
    got = dequantized(ref, data, after)
    assert ref.bits == 7  # fedshard's int8 weights use the reduced range; so does the merge
    assert np.abs(numpy_helper.to_array(after[data]).astype(np.int16)).max() <= 64
    want = dequantized(ref, data, index) + 2.0 * (b @ a).T
    step = float(np.max(numpy_helper.to_array(after[ref.scale])))
    assert np.abs(got - want).max() <= step
    assert np.abs(got - dequantized(ref, data, index)).max() > 10 * step


def test_a_merged_int8_product_computes_the_merged_weight() -> None:
    """int8 products subtract each row's zero point times the weight's column sums
    (:mod:`partitioner.models.decoders.int8rows`); a merge changes the weight, so it rewrites the
    sums with it, and the merged graph in ONNX Runtime computes ``x @ (W + scale · B · A).T``."""
    import onnxruntime as ort

    from partitioner.models.decoders.int8rows import column_sums_name

    model, w = _quantized("int8")
    wmap = weight_map({"m.weight": w}, model)
    rng = np.random.default_rng(1)
    a = rng.normal(0, 0.3, (2, K)).astype(np.float32)
    b = rng.normal(0, 0.3, (N, 2)).astype(np.float32)
    (merged,) = merged_by_segment([model], {"m": (a, b)}, wmap, 2.0).values()
    (data,) = quantized_weights(model)
    assert column_sums_name(data) in merged
    for tensor in model.graph.initializer:
        if tensor.name in merged:
            tensor.CopyFrom(numpy_helper.from_array(merged[tensor.name], tensor.name))
    x = rng.normal(0, 1, (1, K)).astype(np.float32) + 0.5  # a zero point well above 0
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x})
    want = x @ (w + 2.0 * (b @ a)).T
    assert np.abs(got - want).max() < 0.03 * np.abs(want).max()
