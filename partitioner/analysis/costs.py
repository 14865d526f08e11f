"""Tensor sizes and node FLOPs at a sample binding of the symbolic dimensions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from partitioner.errors import GraphError

DEFAULT_DIM = 4
"""Value for a symbolic dimension nobody bound."""

_SUB_BYTE_BITS: dict[int, int] = {
    TensorProto.UINT4: 4,
    TensorProto.INT4: 4,
    TensorProto.FLOAT4E2M1: 4,
    TensorProto.UINT2: 2,
    TensorProto.INT2: 2,
    TensorProto.FLOAT6E2M3: 6,
    TensorProto.FLOAT6E3M2: 6,
}


def element_bits(elem_type: int) -> int:
    """Bits per element of an ONNX element type (strings count as 8 bytes each)."""
    if elem_type in _SUB_BYTE_BITS:
        return _SUB_BYTE_BITS[elem_type]
    if elem_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 64
    return int(onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize) * 8


def tensor_bytes(elem_type: int, elements: int) -> int:
    """Bytes of ``elements`` values of ``elem_type``, rounded up."""
    return (elements * element_bits(elem_type) + 7) // 8


def tensor_proto_bytes(tensor: TensorProto) -> int:
    """Bytes of an initializer's data, from its declared dims and type (no data needed)."""
    return tensor_bytes(tensor.data_type, math.prod(tensor.dims))


@dataclass(frozen=True)
class TensorShape:
    """A tensor's element type and concrete shape at the sample binding."""

    elem_type: int
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Number of elements."""
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return tensor_bytes(self.elem_type, self.elements)


@dataclass(frozen=True)
class ShapeTable:
    """Concrete shapes of every tensor at one sample binding of the symbolic dimensions."""

    shapes: Mapping[str, TensorShape]
    estimated: frozenset[str]
    """Tensors whose shape inference could not size; their size is a guess."""
    dims: Mapping[str, int]
    """The binding used: symbolic dimension name → value."""

    def nbytes(self, name: str) -> int:
        """Bytes of tensor ``name`` (0 if unknown)."""
        shape = self.shapes.get(name)
        return shape.nbytes if shape else 0

    def elements(self, name: str) -> int:
        """Elements of tensor ``name`` (0 if unknown)."""
        shape = self.shapes.get(name)
        return shape.elements if shape else 0

    def dims_of(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (empty if unknown)."""
        shape = self.shapes.get(name)
        return shape.dims if shape else ()


def bind_input_shapes(
    graph: onnx.GraphProto,
    inputs: Sequence[str],
    dims: Mapping[str, int],
    concrete: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Concrete shapes for the graph inputs, and the full binding of symbolic dimension names.

    ``concrete`` (e.g. the shapes of sample inputs) wins, then ``dims`` by dimension name, then
    :data:`DEFAULT_DIM`.
    """
    binding = dict(dims)
    declared = {i.name: i for i in graph.input}
    given_all = concrete or {}
    for name in inputs:  # sample shapes bind first, whatever the input order
        _bind_given(name, declared[name].type, given_all.get(name, ()), binding)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in inputs:
        tensor_type = declared[name].type.tensor_type
        given = [int(v) for v in given_all.get(name, ())]
        if not tensor_type.HasField("shape"):
            if name not in given_all:
                raise GraphError(
                    f"model input {name!r} declares no shape; give sample inputs to size it"
                )
            shapes[name] = tuple(given)
            continue
        shapes[name] = tuple(
            _axis_size(axis, dim, given, binding) for axis, dim in enumerate(tensor_type.shape.dim)
        )
    return shapes, binding


def _bind_given(
    name: str, type_proto: onnx.TypeProto, given: Sequence[int], binding: dict[str, int]
) -> None:
    """Bind the symbolic dimensions of input ``name`` to the sizes it was ``given``."""
    if not type_proto.HasField("tensor_type"):
        raise GraphError(f"model input {name!r} is not a tensor; only tensor inputs are supported")
    for dim, value in zip(type_proto.tensor_type.shape.dim, given, strict=False):
        if dim.dim_param:
            binding[dim.dim_param] = int(value)


def _axis_size(
    axis: int, dim: onnx.TensorShapeProto.Dimension, given: Sequence[int], binding: dict[str, int]
) -> int:
    """One axis: the given size, else the declared one, else its symbol's binding (or default)."""
    if axis < len(given):
        return given[axis]
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.dim_param:
        return binding.setdefault(dim.dim_param, DEFAULT_DIM)
    return DEFAULT_DIM


_MATMUL_A = {
    "MatMul": 0,
    "MatMulInteger": 0,
    "QLinearMatMul": 0,
    "FusedMatMul": 0,
    "MatMulNBits": 0,
}
_CONV_W = {"Conv": 1, "ConvInteger": 1, "QLinearConv": 3, "FusedConv": 1, "NhwcConv": 1}
_RNN = frozenset({"LSTM", "GRU", "RNN"})


_GATHERS = frozenset({"Gather", "GatherElements", "GatherND", "GatherBlockQuantized"})


VIEW_OPS = frozenset(
    {
        "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout",
        "Shape", "Size", "Constant", "ConstantOfShape", "Range",
    }
)  # fmt: skip
"""Operators ONNX Runtime runs without a pass over their elements: views and shape arithmetic."""


def is_vector_op(op_type: str) -> bool:
    """Whether ``op_type`` is element-wise work, priced per element at a device's vector roof:
    every operator but products, convolutions, recurrences, gathers, views and ``TopK`` (which
    has a cost of its own)."""
    return (
        op_type not in _MATMUL_A
        and op_type not in _CONV_W
        and op_type not in _RNN
        and op_type not in _GATHERS
        and op_type not in VIEW_OPS
        and op_type not in ("Gemm", "ConvTranspose", "Einsum", "TopK")
    )


def node_flops(node: onnx.NodeProto, inputs: Sequence[str], table: ShapeTable) -> int:
    """Estimated floating-point operations of one node at the table's binding.

    Matrix products and convolutions count two per multiply-add; gathers one per element
    they output (a row looked up is not a pass over the table); everything else one per
    element of its largest input or output.
    """
    outs = [o for o in node.output if o]
    out_elems = sum(table.elements(o) for o in outs)
    op = node.op_type
    if op in _MATMUL_A and inputs:
        k = _last_dim(table.dims_of(inputs[_MATMUL_A[op]]))
        if op == "MatMulNBits":
            k = _int_attr(node, "K", k)
        return 2 * out_elems * k
    if op == "Gemm" and inputs:
        a = table.dims_of(inputs[0])
        k = (a[0] if _int_attr(node, "transA", 0) else a[-1]) if len(a) == 2 else 1
        return 2 * out_elems * k + out_elems
    if op in _CONV_W and len(inputs) > _CONV_W[op]:
        w = table.dims_of(inputs[_CONV_W[op]])
        return 2 * out_elems * math.prod(w[1:]) if w else out_elems
    if op == "ConvTranspose" and len(inputs) > 1:
        w = table.dims_of(inputs[1])
        return 2 * table.elements(inputs[0]) * math.prod(w[1:]) if w else out_elems
    if op == "Einsum":
        return _einsum_flops(node, inputs, table, out_elems)
    if op in _RNN and len(inputs) > 2:
        x = table.dims_of(inputs[0])
        steps = math.prod(x[:2]) if len(x) >= 2 else 1
        return 2 * steps * (table.elements(inputs[1]) + table.elements(inputs[2]))
    if op in _GATHERS:
        return out_elems
    largest_in = max((table.elements(i) for i in inputs), default=0)
    return max(out_elems, largest_in)


def _last_dim(dims: tuple[int, ...]) -> int:
    return dims[-1] if dims else 1


def _int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for attr in node.attribute:
        if attr.name == name:
            return int(attr.i)
    return default


def _einsum_flops(
    node: onnx.NodeProto, inputs: Sequence[str], table: ShapeTable, fallback: int
) -> int:
    equation = next((a.s.decode() for a in node.attribute if a.name == "equation"), "")
    terms = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, name in zip(terms, inputs, strict=False):
        dims = table.dims_of(name)
        letters = [c for c in term if c.isalpha()]
        if "..." in term or len(letters) != len(dims):
            return 2 * max(fallback, max((table.elements(i) for i in inputs), default=0))
        sizes.update(zip(letters, dims, strict=True))
    return 2 * math.prod(sizes.values()) if sizes else fallback
