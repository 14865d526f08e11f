"""A hand-written ONNX protobuf writer: models serialized without the ``onnx`` package.

The agent does not depend on ``onnx``; the micro-benchmarks (:mod:`edge_agent.profile`), the
fixed-cost probes (:mod:`edge_agent.runtime.fixed_costs`) and ONNX Runtime's priming run
(:func:`edge_agent.runtime.engine.prime`) write their small models with these functions, field
by field, as protobuf's wire format lays them out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_FLOAT = 1  # TensorProto.FLOAT


def matmul_model_bytes(n: int, count: int) -> bytes:
    """A serialized ONNX model: ``y = ((x @ w) @ w) ...`` with ``count`` MatMuls of ``n x n``."""
    shape = [n, n]
    nodes = []
    prev = "x"
    for i in range(count):
        out = "y" if i == count - 1 else f"h{i}"
        nodes.append(node_bytes("MatMul", [prev, "w"], [out], f"mm{i}"))
        prev = out
    return model_bytes(nodes, "fedshard_microbench", [("x", shape), ("w", shape)], [("y", shape)])


def model_bytes(
    nodes: list[bytes],
    name: str,
    inputs: Sequence[tuple[str, Sequence[int | str]]],
    outputs: Sequence[tuple[str, Sequence[int | str]]],
    types: dict[str, int] | None = None,
    initializers: Sequence[bytes] = (),
    opsets: Sequence[tuple[str, int]] = (("", 17),),
) -> bytes:
    """A serialized ONNX model of ``nodes`` (from :func:`node_bytes`) with ``initializers``
    (from :func:`initializer_bytes`), ``inputs`` and ``outputs`` of the given shapes (a string
    is a symbolic dimension), float32 unless ``types`` gives a ``TensorProto`` element type by
    name, importing ``opsets`` (domain, version; the default opset 17)."""
    kinds = types or {}
    graph = b"".join(
        [
            *(field_bytes(1, node) for node in nodes),
            field_bytes(2, name.encode()),
            *(field_bytes(5, tensor) for tensor in initializers),
            *(
                field_bytes(11, value_info_bytes(n, shape, kinds.get(n, _FLOAT)))
                for n, shape in inputs
            ),
            *(
                field_bytes(12, value_info_bytes(n, shape, kinds.get(n, _FLOAT)))
                for n, shape in outputs
            ),
        ]
    )
    imports = b"".join(
        field_bytes(8, field_bytes(1, domain.encode()) + varint_field_bytes(2, version))
        for domain, version in opsets
    )
    return varint_field_bytes(1, 8) + field_bytes(2, b"fedshard") + field_bytes(7, graph) + imports


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def varint_field_bytes(number: int, value: int) -> bytes:
    """A protobuf varint field."""
    return _varint(number << 3) + _varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A protobuf length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def int_attribute_bytes(name: str, value: int) -> bytes:
    """A serialized ``AttributeProto`` of type INT (negative values as protobuf's int64)."""
    encoded = value & 0xFFFFFFFFFFFFFFFF
    kind = varint_field_bytes(20, 2)  # AttributeProto.INT
    return field_bytes(1, name.encode()) + varint_field_bytes(3, encoded) + kind


def initializer_bytes(name: str, array: np.ndarray, data_type: int = _FLOAT) -> bytes:
    """A serialized ``TensorProto`` initializer: ``array``'s raw little-endian bytes."""
    dims = b"".join(varint_field_bytes(1, d) for d in array.shape)
    return (
        dims
        + varint_field_bytes(2, data_type)
        + field_bytes(8, name.encode())
        + field_bytes(9, np.ascontiguousarray(array).tobytes())
    )


def node_bytes(op: str, inputs: list[str], outputs: list[str], name: str) -> bytes:
    """A serialized ``NodeProto`` without attributes."""
    return b"".join(
        [
            *(field_bytes(1, i.encode()) for i in inputs),
            *(field_bytes(2, o.encode()) for o in outputs),
            field_bytes(3, name.encode()),
            field_bytes(4, op.encode()),
        ]
    )


def value_info_bytes(name: str, shape: Sequence[int | str], elem_type: int = _FLOAT) -> bytes:
    """A serialized ``ValueInfoProto``: a tensor's name, element type and shape."""
    dims = b"".join(
        field_bytes(
            1, field_bytes(2, d.encode()) if isinstance(d, str) else varint_field_bytes(1, d)
        )
        for d in shape
    )
    tensor_type = varint_field_bytes(1, elem_type) + field_bytes(2, dims)
    return field_bytes(1, name.encode()) + field_bytes(2, field_bytes(1, tensor_type))
