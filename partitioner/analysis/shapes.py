"""Concrete tensor shapes at a sample binding, propagated node by node.

Whole-graph ONNX shape inference loses track of shapes computed at run time (``Range``,
``Slice`` by a ``Shape``, ``Reshape`` to a computed target). Here every static node whose
inputs are small is *evaluated* with the ONNX reference implementation, so shape arithmetic
yields real numbers, and every other node's output type comes from its operator schema given
concrete input shapes and those values. No weight data is needed (initializer dims suffice), so
this works for models of any size. Tensors still unsized (data-dependent shapes, operators ONNX
has no schema for) are estimated from their producer's largest non-weight input and listed in
:attr:`ShapeTable.estimated`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx.defs
import onnx.shape_inference
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from partitioner.analysis.contrib_shapes import contrib_output_shapes, has_rule
from partitioner.analysis.costs import (
    ShapeTable,
    TensorShape,
    bind_input_shapes,
    tensor_proto_bytes,
)
from partitioner.analysis.graph import GraphIndex
from partitioner.errors import GraphError, UncostableOperatorError

VALUE_LIMIT_ELEMENTS = 1 << 16
"""Static nodes whose inputs hold at most this many elements in total are evaluated."""

_EVAL_ERRORS = (
    ValueError,
    TypeError,
    RuntimeError,
    NotImplementedError,
    IndexError,
    KeyError,
    AttributeError,
)


def infer_shapes(
    model: onnx.ModelProto,
    index: GraphIndex,
    dims: Mapping[str, int],
    concrete: Mapping[str, Sequence[int]] | None = None,
) -> ShapeTable:
    """Concrete shapes of every tensor with the symbolic dimensions bound.

    ``concrete`` gives actual input shapes (e.g. of sample inputs); ``dims`` binds symbolic
    dimension names; anything else unbound gets :data:`partitioner.analysis.costs.DEFAULT_DIM`.
    """
    input_shapes, binding = bind_input_shapes(model.graph, index.inputs, dims, concrete)
    prop = _Propagator(model, frozenset(index.initializers))
    declared = {i.name: i for i in model.graph.input}
    for name in index.inputs:
        prop.set(name, declared[name].type.tensor_type.elem_type, input_shapes[name])
    for name, tensor in index.initializers.items():
        prop.set(name, tensor.data_type, tuple(tensor.dims))
        if _has_data(tensor) and math.prod(tensor.dims) <= VALUE_LIMIT_ELEMENTS:
            prop.values[name] = numpy_helper.to_array(tensor)
    for i, node in enumerate(index.nodes):
        prop.visit(node, index.node_inputs[i], i in index.static)
    return ShapeTable(shapes=prop.shapes, estimated=frozenset(prop.estimated), dims=binding)


def _has_data(tensor: TensorProto) -> bool:
    return tensor.data_location != TensorProto.EXTERNAL or tensor.HasField("raw_data")


class _Propagator:
    """Walks nodes in order, keeping a concrete shape per tensor and values of small statics."""

    def __init__(self, model: onnx.ModelProto, weights: frozenset[str]) -> None:
        self.model = model
        self.weights = weights
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.shapes: dict[str, TensorShape] = {}
        self.values: dict[str, np.ndarray] = {}
        self.estimated: set[str] = set()

    def set(self, name: str, elem_type: int, dims: Sequence[int]) -> None:
        self.shapes[name] = TensorShape(elem_type, tuple(int(d) for d in dims))

    def visit(self, node: onnx.NodeProto, inputs: Sequence[str], static: bool) -> None:
        outs = [o for o in node.output if o]
        if static and self._evaluate(node):
            return
        self._infer(node, inputs)
        missing = [o for o in outs if o not in self.shapes]
        if missing:
            activations = [n for n in inputs if n not in self.weights]
            known = [self.shapes[n] for n in activations or inputs if n in self.shapes]
            largest = max(
                known, key=lambda s: s.elements, default=TensorShape(TensorProto.FLOAT, ())
            )
            for out in missing:
                self.shapes[out] = largest
                self.estimated.add(out)

    def _evaluate(self, node: onnx.NodeProto) -> bool:
        names = [n for n in node.input if n]
        if node.op_type in ("Shape", "Size") and names and names[0] in self.shapes:
            self._shape_of(node, self.shapes[names[0]].dims)
            return True
        if any(n not in self.values for n in names):
            return False
        if sum(self.values[n].size for n in names) > VALUE_LIMIT_ELEMENTS:
            return False
        graph = onnx.helper.make_graph(
            [node],
            "eval",
            [
                onnx.helper.make_tensor_value_info(n, _elem(self.values[n]), self.values[n].shape)
                for n in names
            ],
            [onnx.helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o],
        )
        mini = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import))
        mini.ir_version = self.model.ir_version
        try:
            results = ReferenceEvaluator(mini).run(None, {n: self.values[n] for n in names})
        except _EVAL_ERRORS:
            return False
        for out, value in zip([o for o in node.output if o], results, strict=False):
            array = np.asarray(value)
            self.values[out] = array
            self.set(out, _elem(array), array.shape)
        return True

    def _shape_of(self, node: onnx.NodeProto, dims: tuple[int, ...]) -> None:
        if node.op_type == "Size":
            value = np.array(math.prod(dims), dtype=np.int64)
        else:
            attrs = {a.name: int(a.i) for a in node.attribute}
            start, end = attrs.get("start", 0), attrs.get("end", len(dims))
            value = np.array(dims[slice(start, end)], dtype=np.int64)
        self.values[node.output[0]] = value
        self.set(node.output[0], TensorProto.INT64, value.shape)

    def _infer(self, node: onnx.NodeProto, inputs: Sequence[str]) -> None:
        if any(n not in self.shapes for n in inputs):
            return
        try:
            schema = onnx.defs.get_schema(
                node.op_type, self.opsets.get(node.domain or "", 1), node.domain
            )
        except onnx.defs.SchemaError:
            self._contrib(node, inputs)
            return
        types = {
            n: onnx.helper.make_tensor_type_proto(self.shapes[n].elem_type, self.shapes[n].dims)
            for n in inputs
        }
        data = {
            n: numpy_helper.from_array(self.values[n], n) for n in node.input if n in self.values
        }
        try:
            found = onnx.shape_inference.infer_node_outputs(
                schema,
                node,
                types,
                data,
                opset_imports=list(self.model.opset_import),
                ir_version=self.model.ir_version,
            )
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            return
        for out, type_proto in found.items():
            tt = type_proto.tensor_type
            if type_proto.HasField("tensor_type") and tt.HasField("shape"):
                dims = tt.shape.dim
                if all(d.HasField("dim_value") for d in dims):
                    self.set(out, tt.elem_type, [d.dim_value for d in dims])

    def _contrib(self, node: onnx.NodeProto, inputs: Sequence[str]) -> None:
        """Outputs of an operator ONNX has no schema for, by
        :mod:`partitioner.analysis.contrib_shapes`."""
        if not has_rule(node):
            raise UncostableOperatorError(node.domain, node.op_type, node.name or node.output[0])
        found = contrib_output_shapes(node, [self.shapes.get(n) for n in node.input])
        for out, shape in zip([o for o in node.output if o], found or [], strict=False):
            self.shapes[out] = shape


def _elem(array: np.ndarray) -> int:
    return int(onnx.helper.np_dtype_to_tensor_dtype(array.dtype))


def symbolic_types(model: onnx.ModelProto, index: GraphIndex) -> dict[str, onnx.ValueInfoProto]:
    """Type of every tensor with symbolic dims where known: what segment inputs/outputs declare.

    Uses the model's own value_info first, then ONNX shape inference on a weightless copy.
    """
    light = weightless_copy(model, index)
    try:
        done = onnx.shape_inference.infer_shapes(light, strict_mode=False, data_prop=False)
    except onnx.shape_inference.InferenceError as exc:
        raise GraphError(f"ONNX shape inference rejects the model: {exc}") from exc
    infos: dict[str, onnx.ValueInfoProto] = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        infos.setdefault(vi.name, vi)
    for vi in [*done.graph.input, *done.graph.value_info, *done.graph.output]:
        infos.setdefault(vi.name, vi)
    return infos


def weightless_copy(model: onnx.ModelProto, index: GraphIndex) -> onnx.ModelProto:
    """The live graph with large initializers turned into typed inputs (no weight data)."""
    graph = onnx.GraphProto(name=model.graph.name)
    graph.node.extend(index.nodes)
    declared = {i.name: i for i in model.graph.input}
    graph.input.extend(declared[name] for name in index.inputs)
    for name, tensor in index.initializers.items():
        if tensor_proto_bytes(tensor) <= 8192 and _has_data(tensor):
            graph.initializer.append(tensor)
        else:
            graph.input.append(
                onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims))
            )
    graph.sparse_initializer.extend(model.graph.sparse_initializer)
    graph.output.extend(model.graph.output)
    graph.value_info.extend(model.graph.value_info)
    light = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
    light.opset_import.extend(model.opset_import)
    return light
