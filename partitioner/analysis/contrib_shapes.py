"""Output shapes of the ONNX Runtime contrib operators that quantized models use.

ONNX ships no schema for ``com.microsoft`` operators, so :mod:`partitioner.analysis.shapes` cannot
infer their outputs. The ones ONNX Runtime's own quantizers write get a rule here:

- ``MatMulNBits`` (``matmul_nbits_quantizer``): ``A[..., K]`` times a ``K x N`` weight stored
  in ``bits``-bit blocks; output ``A[...] + [N]`` in ``A``'s type.
- ``GatherBlockQuantized``: a gather from a block-quantized table; output
  ``data[:axis] + indices + data[axis+1:]`` in the scales' type, where a ``uint8`` table packs
  ``8 / bits`` values per byte along its last axis.

Any other operator without a schema is not guessed at: :func:`contrib_output_shapes` returns
``None`` and the caller raises :class:`~partitioner.errors.UncostableOperatorError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import TensorProto

from partitioner.analysis.costs import TensorShape

Rule = Callable[[onnx.NodeProto, Sequence[TensorShape | None]], list[TensorShape] | None]


def _int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _matmul_nbits(
    node: onnx.NodeProto, inputs: Sequence[TensorShape | None]
) -> list[TensorShape] | None:
    a = inputs[0] if inputs else None
    n = _int_attr(node, "N", 0)
    if a is None or not a.dims or n <= 0:
        return None
    return [TensorShape(a.elem_type, (*a.dims[:-1], n))]


def _gather_block_quantized(
    node: onnx.NodeProto, inputs: Sequence[TensorShape | None]
) -> list[TensorShape] | None:
    if len(inputs) < 3 or any(s is None for s in inputs[:3]):
        return None
    data, indices, scales = inputs[0], inputs[1], inputs[2]
    assert data is not None and indices is not None and scales is not None
    dims = list(data.dims)
    if data.elem_type == TensorProto.UINT8 and dims:
        dims[-1] *= 8 // _int_attr(node, "bits", 4)
    axis = _int_attr(node, "gather_axis", 0) % max(1, len(dims))
    return [TensorShape(scales.elem_type, (*dims[:axis], *indices.dims, *dims[axis + 1 :]))]


RULES: dict[tuple[str, str], Rule] = {
    ("com.microsoft", "MatMulNBits"): _matmul_nbits,
    ("com.microsoft", "GatherBlockQuantized"): _gather_block_quantized,
}
"""Shape rules by ``(domain, op_type)``."""


def has_rule(node: onnx.NodeProto) -> bool:
    """Whether :data:`RULES` sizes ``node``'s outputs."""
    return (node.domain, node.op_type) in RULES


def contrib_output_shapes(
    node: onnx.NodeProto, inputs: Sequence[TensorShape | None]
) -> list[TensorShape] | None:
    """Output shapes of ``node`` given its inputs' (``None`` where unknown), or ``None`` when
    no rule applies or an input it needs is unknown."""
    rule = RULES.get((node.domain, node.op_type))
    return None if rule is None else rule(node, inputs)
