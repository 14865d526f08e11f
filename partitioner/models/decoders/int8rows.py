"""int8 activations quantized per row, so that a verify pass decodes each token as a step does.

``quantize_dynamic`` quantizes each ``MatMulInteger``'s activations with one
``DynamicQuantizeLinear`` per tensor: one scale and zero point over every row of the pass. A
token's activations are then rounded differently in a one-token step and in a pass that
verifies several drafted tokens, and its logits move by whole hundredths, so an int8 decoder
could not speculate and still decode as plain steps do.

:func:`per_row_activations` gives every row its own scale and zero point, computed exactly as
``DynamicQuantizeLinear`` defines them but over the row alone (``ReduceMin``/``ReduceMax`` on
the last axis). ONNX Runtime's CPU ``MatMulInteger`` takes only one zero point for its left
operand, so the product runs with none and each row's zero point is taken out afterwards in
int32: ``(q - z) @ W = q @ W - z * colsum(W)``, where ``colsum`` is the weight's column sums
less its zero points, a constant of the export. The integer product is exact (7-bit weights
never saturate the kernels, see
:data:`~partitioner.models.decoders.ort_quantizers.INT8_REDUCE_RANGE`), so each row's result depends
on that row alone. The float products left (attention) are padded to two rows by
:func:`~partitioner.models.decoders.rowwise.two_row_products`; the export then checks the written
graph on its machine, as for int4.

Every other node is kept. The per-tensor ``Mul`` of the activation scale by the weight scales
broadcasts a per-row scale to one per row and output column, as before with one scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from partitioner.errors import GraphError

SUFFIX = "/per_row"
"""Suffix of the names of the nodes and tensors :func:`per_row_activations` adds."""
_ZERO_U8 = "fedshard.per_row.zero_u8"
_CONSTANTS = {
    "fedshard.per_row.zero": np.array(0.0, np.float32),
    "fedshard.per_row.levels": np.array(255.0, np.float32),
    "fedshard.per_row.tiny": np.array(np.finfo(np.float32).tiny, np.float32),
}
_AXES = "fedshard.per_row.axes"
INT32, UINT8 = TensorProto.INT32, TensorProto.UINT8
READER_OPSET = 18
"""From this opset ``ReduceMin``/``ReduceMax`` take their axes as an input, before as an
attribute."""


def per_row_activations(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (as ``quantize_dynamic`` writes it) with each ``DynamicQuantizeLinear``
    quantizing per row of its input's last axis (see the module docstring).

    ``model`` is modified and returned. :class:`GraphError` if a ``DynamicQuantizeLinear``'s
    zero point is read by anything but a ``MatMulInteger`` (which is rewritten), or such a
    ``MatMulInteger``'s weight or weight zero point is not an initializer.
    """
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    weights = {t.name: t for t in graph.initializer}
    dql_zero_points = {n.output[2]: n for n in graph.node if n.op_type == "DynamicQuantizeLinear"}
    if not dql_zero_points:
        return model
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    for node in graph.node:
        if node.op_type == "DynamicQuantizeLinear":
            nodes.extend(_row_quantizer(node, opset))
        elif node.op_type == "MatMulInteger" and node.input[2] in dql_zero_points:
            nodes.extend(_corrected_product(node, weights, added))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in _CONSTANTS.items())
    graph.initializer.append(numpy_helper.from_array(np.array(0, np.uint8), _ZERO_U8))
    if opset >= READER_OPSET:
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), _AXES))
    _check_zero_points_consumed(graph, set(dql_zero_points))
    return model


def _row_zero_point(name: str) -> str:
    """The int32 per-row zero point standing for ``DynamicQuantizeLinear`` output ``name``."""
    return name + SUFFIX + "/int32"


def _reduce(op: str, x: str, out: str, opset: int) -> onnx.NodeProto:
    if opset >= READER_OPSET:
        return helper.make_node(op, [x, _AXES], [out], name=out, keepdims=1)
    return helper.make_node(op, [x], [out], name=out, axes=[-1], keepdims=1)


def _row_quantizer(node: onnx.NodeProto, opset: int) -> list[onnx.NodeProto]:
    """``DynamicQuantizeLinear(x) -> q, scale, zero_point`` over each row of ``x`` alone: the
    same ``q`` and ``scale`` names (the scale now one per row), and an int32 zero point per row
    under :func:`_row_zero_point` (the uint8 one is not needed)."""
    (x,) = node.input
    q, scale, zero_point = node.output
    b = (node.name or q) + SUFFIX
    zero, levels, tiny = _CONSTANTS
    mk = helper.make_node
    return [
        _reduce("ReduceMin", x, f"{b}/min", opset),
        _reduce("ReduceMax", x, f"{b}/max", opset),
        mk("Min", [f"{b}/min", zero], [f"{b}/low"], name=f"{b}/low"),
        mk("Max", [f"{b}/max", zero], [f"{b}/high"], name=f"{b}/high"),
        mk("Sub", [f"{b}/high", f"{b}/low"], [f"{b}/range"], name=f"{b}/range"),
        mk("Div", [f"{b}/range", levels], [f"{b}/raw_scale"], name=f"{b}/raw_scale"),
        mk("Max", [f"{b}/raw_scale", tiny], [scale], name=f"{b}/scale"),
        mk("Div", [f"{b}/low", scale], [f"{b}/low_q"], name=f"{b}/low_q"),
        mk("Sub", [zero, f"{b}/low_q"], [f"{b}/zp_raw"], name=f"{b}/zp_raw"),
        mk("Round", [f"{b}/zp_raw"], [f"{b}/zp_round"], name=f"{b}/zp_round"),
        mk("Clip", [f"{b}/zp_round", zero, levels], [f"{b}/zp"], name=f"{b}/zp"),
        mk("Cast", [f"{b}/zp"], [_row_zero_point(zero_point)], name=f"{b}/zp32", to=INT32),
        mk("Div", [x, scale], [f"{b}/x_q"], name=f"{b}/x_q"),
        mk("Round", [f"{b}/x_q"], [f"{b}/x_round"], name=f"{b}/x_round"),
        mk("Add", [f"{b}/x_round", f"{b}/zp"], [f"{b}/x_shift"], name=f"{b}/x_shift"),
        mk("Clip", [f"{b}/x_shift", zero, levels], [f"{b}/x_clip"], name=f"{b}/x_clip"),
        mk("Cast", [f"{b}/x_clip"], [q], name=f"{b}/q", to=UINT8),
    ]


def _corrected_product(
    node: onnx.NodeProto, weights: dict[str, onnx.TensorProto], added: list[onnx.TensorProto]
) -> list[onnx.NodeProto]:
    """``MatMulInteger(q, W, z, w_z) -> y`` as ``q @ (W - w_z) - z * colsum`` in int32, with
    ``z`` the per-row zero point (see the module docstring); ``colsum`` goes to ``added``."""
    q, weight, zero_point = node.input[:3]
    weight_zero_point = _optional_input(node, 3)
    (out,) = node.output
    if weight not in weights:
        raise GraphError(f"MatMulInteger {node.name!r}: weight {weight!r} is not an initializer")
    if weight_zero_point and weight_zero_point not in weights:
        raise GraphError(f"MatMulInteger {node.name!r}: its weight zero point is not constant")
    arrays = {k: numpy_helper.to_array(weights[k]) for k in (weight, weight_zero_point) if k}
    w = _centred(arrays, weight, weight_zero_point)
    b = (node.name or out) + SUFFIX
    colsum = column_sums_name(weight)
    if colsum not in {t.name for t in added}:
        added.append(numpy_helper.from_array(w.sum(axis=0, dtype=np.int32), colsum))
    product_inputs = [q, weight, _ZERO_U8] + ([weight_zero_point] if weight_zero_point else [])
    mk = helper.make_node
    return [
        mk("MatMulInteger", product_inputs, [f"{b}/raw"], name=f"{b}/product"),
        mk("Mul", [_row_zero_point(zero_point), colsum], [f"{b}/shift"], name=f"{b}/shift"),
        mk("Sub", [f"{b}/raw", f"{b}/shift"], [out], name=f"{b}/corrected"),
    ]


def column_sums_name(weight: str) -> str:
    """The initializer holding the column sums of ``MatMulInteger`` weight ``weight``."""
    return weight + SUFFIX + "/colsum"


def _centred(arrays: Mapping[str, np.ndarray], weight: str, zero_point: str | None) -> np.ndarray:
    """The weight less its zero point, in int32."""
    w = np.asarray(arrays[weight]).astype(np.int32)
    return w - np.asarray(arrays[zero_point]).astype(np.int32) if zero_point else w


def refreshed_column_sums(
    nodes: Iterable[onnx.NodeProto],
    changed: Mapping[str, np.ndarray],
    stored: Mapping[str, onnx.TensorProto],
) -> dict[str, np.ndarray]:
    """The column sums that go with int8 weights given new values (a merged LoRA update).

    ``changed`` maps initializer names to their new arrays, ``stored`` every initializer as
    it is; the result maps each column-sum initializer of a ``MatMulInteger`` whose weight or
    weight zero point is in ``changed`` to its new sums, so that the rewritten product stays
    ``(q - z) @ (W - w_z)`` with the new weight (stale sums would shift every output).
    """
    out: dict[str, np.ndarray] = {}
    for node in nodes:
        if node.op_type != "MatMulInteger" or len(node.input) < 2:
            continue
        weight, zero_point = node.input[1], _optional_input(node, 3)
        colsum = column_sums_name(weight)
        if colsum not in stored or not ({weight, zero_point or ""} & changed.keys()):
            continue
        arrays = {k: changed[k] if k in changed else numpy_helper.to_array(stored[k])
                  for k in (weight, zero_point) if k}  # fmt: skip
        out[colsum] = _centred(arrays, weight, zero_point).sum(axis=0, dtype=np.int32)
    return out


def _optional_input(node: onnx.NodeProto, index: int) -> str | None:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _check_zero_points_consumed(graph: onnx.GraphProto, zero_points: set[str]) -> None:
    """:class:`GraphError` if a per-tensor zero point is still read (by a node left as it was)."""
    for node in graph.node:
        for name in node.input:
            if name in zero_points:
                raise GraphError(
                    f"{node.op_type} {node.name!r} reads the per-tensor zero point {name!r}; "
                    "only MatMulInteger may read it for per-row activations"
                )
