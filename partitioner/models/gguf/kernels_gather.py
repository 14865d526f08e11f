"""Embedding rows of GGUF blocks through ``GatherBlockQuantized``, bit for bit.

The codes go into a uint8 ``GatherBlockQuantized`` (gather axis 0, quantize axis 1) under its
default zero point ``2**(bits-1)``: 4-bit where every code minus the type's zero plus 8 fits
in a nibble (Q4_0, Q3_K, Q2_K), else 8-bit. It returns ``(code - zero) * scale`` in float32,
which is how gguf-py forms the value; types with a per-block min (Q4_1, Q5_1, Q2_K, Q4_K,
Q5_K) then add the gathered mins per block (``v + low`` is ggml's ``d*q - dmin*m``, as
``a + (-b) == a - b`` in IEEE arithmetic).
"""

from __future__ import annotations

import numpy as np
import onnx
from gguf import GGMLQuantizationType
from onnx import TensorProto, helper, numpy_helper

from partitioner.models.gguf.kernels_codes import (
    MS_DOMAIN,
    Codes,
    GraphPart,
    Layout,
    array_tensor,
    decode_stored,
    default_zero_shift,
    int64_constant,
    layout,
)


def gather_bits(lay: Layout) -> int:
    """4 where the shifted codes fit a nibble under the default zero point 8, else 8."""
    return 4 if default_zero_shift(lay, 4) is not None else 8


def quantized_gather(name: str, ids: str, codes: Codes) -> GraphPart:
    """``GatherBlockQuantized`` of ``codes`` (plus the mins) for int64 ``ids``: ``{name}/out``."""
    lay = codes.layout
    n_cols = codes.codes.shape[1]
    bits = gather_bits(lay)
    stored = np.add(codes.codes, np.uint8((1 << (bits - 1)) - lay.zero), out=codes.codes)
    if bits == 4:
        stored = stored[:, 0::2] | (stored[:, 1::2] << np.uint8(4))
    data = numpy_helper.from_array(np.ascontiguousarray(stored), f"{name}.qtable")
    return _gather_part(name, ids, data, codes.scales, codes.lows, lay, n_cols, bits)


def streamed_gather(
    name: str, ids: str, raw: np.ndarray, ggml_type: GGMLQuantizationType, n_rows: int, n_cols: int
) -> GraphPart:
    """:func:`quantized_gather` of ``decode(raw)``, the table's codes stored row chunk by row
    chunk straight into its initializer (no full-size code array beside it)."""
    lay = layout(ggml_type)
    bits = gather_bits(lay)
    done = decode_stored(raw, ggml_type, n_rows, n_cols, (1 << (bits - 1)) - lay.zero, bits)
    holder = [done.stored]
    scales, lows = done.scales, done.lows
    del done
    data = array_tensor(f"{name}.qtable", holder)
    return _gather_part(name, ids, data, scales, lows, lay, n_cols, bits)


def _gather_part(
    name: str,
    ids: str,
    data: TensorProto,
    scale_values: np.ndarray,
    lows: np.ndarray | None,
    lay: Layout,
    n_cols: int,
    bits: int,
) -> GraphPart:
    scales = numpy_helper.from_array(scale_values, f"{name}.scales")
    out = f"{name}/out"
    node = helper.make_node(
        "GatherBlockQuantized",
        [data.name, ids, scales.name],
        [out if lows is None else f"{name}/scaled"],
        f"{name}/GatherBlockQuantized",
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=lay.block,
        bits=bits,
    )
    if lows is None:
        return GraphPart((node,), (data, scales), out)
    nodes, inits = _add_lows(name, ids, f"{name}/scaled", lows, lay.block, n_cols)
    return GraphPart((node, *nodes), (data, scales, *inits), out)


def _add_lows(
    name: str, ids: str, scaled: str, lows: np.ndarray, block: int, n_cols: int
) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    blocks = n_cols // block
    p = f"{name}/lows"
    table = numpy_helper.from_array(lows, f"{name}.lows")
    by_block = int64_constant(f"{p}/by_block", [-1, blocks, block])
    per_block = int64_constant(f"{p}/per_block", [-1, blocks, 1])
    width = int64_constant(f"{p}/width", [n_cols])
    nodes = [
        by_block,
        per_block,
        width,
        helper.make_node("Gather", [table.name, ids], [f"{p}/rows"], f"{p}/Gather"),
        helper.make_node("Reshape", [f"{p}/rows", per_block.output[0]], [f"{p}/col"], f"{p}/Col"),
        helper.make_node("Reshape", [scaled, by_block.output[0]], [f"{p}/blocks"], f"{p}/Blocks"),
        helper.make_node("Add", [f"{p}/blocks", f"{p}/col"], [f"{p}/sum"], f"{p}/Add"),
        helper.make_node("Shape", [ids], [f"{p}/ids_shape"], f"{p}/IdsShape"),
        helper.make_node(
            "Concat", [f"{p}/ids_shape", width.output[0]], [f"{p}/shape"], f"{p}/Shape", axis=0
        ),
        helper.make_node("Reshape", [f"{p}/sum", f"{p}/shape"], [f"{name}/out"], f"{p}/Back"),
    ]
    return nodes, [table]
