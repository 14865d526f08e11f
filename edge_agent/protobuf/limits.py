"""Declared-size checks on an ONNX segment before ONNX Runtime parses it.

A signed segment can still be hostile (a compromised coordinator, a bug): a tensor *declared*
as ``[1<<20, 1<<20]`` floats costs nothing in the file and 4 TiB when something allocates it.
:func:`check_declared_sizes` walks the ONNX protobuf with a small wire-format reader (the agent
has no ``onnx`` package) and refuses, before loading, a segment in which any of these would
need more bytes than the budget allows:

- an initializer, or the value of a ``Constant`` node, by its declared dims and element type;
- a graph input, output or ``value_info`` whose dims are all fixed;
- the shape operand of ``Expand``, ``Reshape`` or ``ConstantOfShape`` when it is a constant
  (an initializer or a ``Constant`` node), counted at one byte per element;
- the warm-up shapes of the manifest, by the input's element type.

Sub-graphs (``If``, ``Loop``) are not walked. Anything the reader cannot parse is refused.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from edge_agent.errors import BudgetError, SegmentLoadError

# ONNX TensorProto.DataType -> bytes per element (strings count as one byte per element).
_ITEMSIZE: Mapping[int, int] = {
    1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 8: 1, 9: 1, 10: 2,
    11: 8, 12: 4, 13: 8, 14: 8, 15: 16, 16: 2, 17: 1, 18: 1, 19: 1, 20: 1, 21: 1, 22: 1,
}  # fmt: skip
_SUB_BYTE_BITS: Mapping[int, int] = {21: 4, 22: 4, 23: 4, 25: 2, 26: 2}
"""UINT4, INT4, FLOAT4E2M1, UINT2, INT2: packed several to a byte (int4 weights)."""
_SHAPE_OPERAND = {"Expand": 1, "Reshape": 1, "ConstantOfShape": 0}

Field = tuple[int, int, int | memoryview]
"""(field number, wire type, varint value or length-delimited bytes)."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise SegmentLoadError("the segment is not a well-formed ONNX protobuf")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _fields(data: memoryview) -> Iterator[Field]:
    """The fields of one protobuf message (wire types 0, 1, 2 and 5)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise SegmentLoadError("the segment is not a well-formed ONNX protobuf")
            yield number, wire, data[pos : pos + length]
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise SegmentLoadError("the segment is not a well-formed ONNX protobuf")
    if pos != len(data):
        raise SegmentLoadError("the segment is not a well-formed ONNX protobuf")


def _ints(wire: int, value: int | memoryview) -> list[int]:
    """A repeated int64 field's values (packed or not), as signed integers."""
    if isinstance(value, int):
        return [value - (1 << 64) if value >= 1 << 63 else value]
    out, pos = [], 0
    while pos < len(value):
        raw, pos = _varint(value, pos)
        out.append(raw - (1 << 64) if raw >= 1 << 63 else raw)
    return out


@dataclass
class _Tensor:
    name: str = ""
    dims: list[int] = field(default_factory=list)
    data_type: int = 0
    int64_data: list[int] = field(default_factory=list)
    raw: bytes = b""


def _tensor(data: memoryview) -> _Tensor:
    tensor = _Tensor()
    for number, wire, value in _fields(data):
        if number == 1:
            tensor.dims += _ints(wire, value)
        elif number == 2 and isinstance(value, int):
            tensor.data_type = value
        elif number == 7:
            tensor.int64_data += _ints(wire, value)
        elif number == 8 and isinstance(value, memoryview):
            tensor.name = bytes(value).decode("utf-8", "replace")
        elif number == 9 and isinstance(value, memoryview) and len(value) <= 1024:
            tensor.raw = bytes(value)  # only small ones: shape operands
    return tensor


def _shape_values(tensor: _Tensor) -> list[int]:
    if tensor.int64_data:
        return tensor.int64_data
    if tensor.data_type == 7 and len(tensor.raw) % 8 == 0:
        return list(struct.unpack(f"<{len(tensor.raw) // 8}q", tensor.raw))
    return []


def _value_info(data: memoryview) -> tuple[str, int, list[int | None]]:
    """Name, element type and dims (None for a symbolic or unknown one) of a ValueInfoProto."""
    name, elem, dims = "", 0, []
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, memoryview):
            name = bytes(value).decode("utf-8", "replace")
        elif number == 2 and isinstance(value, memoryview):
            for n, _, tensor_type in _fields(value):  # TypeProto.tensor_type
                if n != 1 or not isinstance(tensor_type, memoryview):
                    continue
                for m, _, part in _fields(tensor_type):
                    if m == 1 and isinstance(part, int):
                        elem = part
                    elif m == 2 and isinstance(part, memoryview):
                        dims = [_dim(d) for k, _, d in _fields(part) if k == 1]
    return name, elem, dims


def _dim(data: int | memoryview) -> int | None:
    if isinstance(data, int):
        return None
    for number, _, value in _fields(data):
        if number == 1 and isinstance(value, int):
            return value
    return None


def _nbytes(dims: list[int], elem: int, default_itemsize: int = 4) -> int:
    elements = math.prod(max(d, 0) for d in dims)
    if elem in _SUB_BYTE_BITS:
        return (elements * _SUB_BYTE_BITS[elem] + 7) // 8
    return elements * _ITEMSIZE.get(elem, default_itemsize)


@dataclass
class _Graph:
    tensors: list[_Tensor] = field(default_factory=list)
    """Initializers and Constant node values."""
    constants: dict[str, _Tensor] = field(default_factory=dict)
    values: list[tuple[str, int, list[int | None]]] = field(default_factory=list)
    shape_operands: list[tuple[str, str]] = field(default_factory=list)
    """(op type, name of its shape operand)."""


def _graph(data: memoryview) -> _Graph:
    graph = _Graph()
    for number, _, value in _fields(data):
        if not isinstance(value, memoryview):
            continue
        if number == 5:
            tensor = _tensor(value)
            graph.tensors.append(tensor)
            graph.constants[tensor.name] = tensor
        elif number in (11, 12, 13):
            graph.values.append(_value_info(value))
        elif number == 1:
            _node(value, graph)
    return graph


def _node(data: memoryview, graph: _Graph) -> None:
    inputs, outputs, op = [], [], ""
    attributes = []
    for number, _, value in _fields(data):
        if not isinstance(value, memoryview):
            continue
        if number == 1:
            inputs.append(bytes(value).decode("utf-8", "replace"))
        elif number == 2:
            outputs.append(bytes(value).decode("utf-8", "replace"))
        elif number == 4:
            op = bytes(value).decode("utf-8", "replace")
        elif number == 5:
            attributes.append(value)
    if op == "Constant":
        _constant(attributes, outputs, graph)
    operand = _SHAPE_OPERAND.get(op)
    if operand is not None and operand < len(inputs):
        graph.shape_operands.append((op, inputs[operand]))


def _constant(attributes: list[memoryview], outputs: list[str], graph: _Graph) -> None:
    """Record a ``Constant`` node's tensor value (and its output name)."""
    for attribute in attributes:
        for n, _, t in _fields(attribute):
            if n == 5 and isinstance(t, memoryview):  # AttributeProto.t
                tensor = _tensor(t)
                graph.tensors.append(tensor)
                if outputs:
                    graph.constants[outputs[0]] = tensor


def check_declared_sizes(
    segment: bytes | memoryview, budget_bytes: int, warmup_shapes: Mapping[str, list[int]]
) -> None:
    """Refuse (BudgetError) a segment whose declared sizes exceed ``budget_bytes``, and
    (SegmentLoadError) one that is not a well-formed ONNX protobuf."""
    model = memoryview(segment).cast("B")
    graphs = [v for n, _, v in _fields(model) if n == 7 and isinstance(v, memoryview)]
    if len(graphs) != 1:
        raise SegmentLoadError("the segment is not an ONNX model with one graph")
    graph = _graph(graphs[0])

    def refuse(what: str, nbytes: int) -> None:
        if nbytes > budget_bytes:
            raise BudgetError(
                f"{what} declares {nbytes} bytes, over the {budget_bytes}-byte budget; "
                "refused before loading"
            )

    for tensor in graph.tensors:
        refuse(f"tensor {tensor.name!r} {tensor.dims}", _nbytes(tensor.dims, tensor.data_type))
    elems = {}
    for name, elem, dims in graph.values:
        elems[name] = elem
        if dims and all(d is not None for d in dims):
            refuse(f"value {name!r} {dims}", _nbytes([d or 0 for d in dims], elem))
    for op, name in graph.shape_operands:
        constant = graph.constants.get(name)
        if constant is not None:
            shape = _shape_values(constant)
            refuse(f"{op} to {shape}", _nbytes([d for d in shape if d > 0], 0, 1))
    for name, shape in warmup_shapes.items():
        refuse(f"warm-up input {name!r} {shape}", _nbytes(shape, elems.get(name, 0)))
