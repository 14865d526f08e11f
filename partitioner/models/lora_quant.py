"""LoRA over a quantized served decoder (QLoRA-style): find, dequantize, re-quantize its weights.

fedshard serves Gemma 3 270M in int8 (``quantize_dynamic``: ``MatMulInteger`` weights per
output channel, the embedding a per-tensor ``DequantizeLinear`` table) and Qwen in int4
(``MatMulNBits``, ``GatherBlockQuantized``). Devices train adapters over the *dequantized*
served weights (:func:`protocols.quant.dequantize`), so they train what is served; a merge
writes ``W_deq + (alpha / rank) · B · A`` back **re-quantized the way the served initializer
was** (same scheme, axis, block size, symmetry), with ONNX Runtime's own quantizers:
``quant_utils.quantize_data`` per channel (what ``quantize_dynamic`` runs for each channel of
a weight) and ``DefaultWeightOnlyQuantizer.qbits_block_quant`` (what ``MatMulNBitsQuantizer``
runs). Nothing here quantizes by hand.

- :func:`quantized_weights`: every quantized weight of a graph, as a :class:`QuantRef` by the
  name of the initializer holding its data (scale and zero point found from the consuming node;
  ``quantize_dynamic`` gives ``MatMulInteger`` no scale input, so its scale is found by ONNX
  Runtime's naming rule, ``<w>_quantized`` -> ``<w>_scale``).
- :func:`dequantized`: a :class:`QuantRef`'s float weight from a graph's initializers.
- :func:`requantized`: the initializers (data, scale, zero point) for a new float weight.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.errors import GraphError
from protocols.lora import QuantRef
from protocols.quant import dequantize

QUANTIZED_MATMULS = ("MatMulInteger", "MatMulNBits")
"""The operators a quantized decoder multiplies its weights with."""
REDUCED_INT8_MAX = 64
REDUCED_UINT8_MAX = 127
"""The largest magnitudes of ``reduce_range`` int8 and uint8 data (``quant_utils``'
``ONNX_INT_TYPE_REDUCED_RANGE``)."""
QUANT_SUFFIX = "_quantized"
"""ONNX Runtime's ``TENSOR_NAME_QUANT_SUFFIX`` (``<w>_quantized``, ``<w>_scale``)."""


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _zero_is_symmetric(tensor: onnx.TensorProto | None) -> bool:
    return tensor is None or not np.any(numpy_helper.to_array(tensor).astype(np.int64))


def _optional(node: onnx.NodeProto, index: int) -> str | None:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _ref_of(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> tuple[str, QuantRef]:
    """(data initializer, its :class:`QuantRef`) of one quantized node reading a weight."""
    attrs = _attrs(node)
    if node.op_type == "MatMulInteger":
        data, zp = node.input[1], _optional(node, 3)
        scale = data.removesuffix(QUANT_SUFFIX) + "_scale"
        if scale not in inits:
            raise GraphError(f"{data}: no {scale} beside it (not quantize_dynamic's naming)")
        axis = 1 if len(inits[scale].dims) == 1 else None
        shape = list(inits[data].dims)
        return data, QuantRef(
            scheme="linear", scale=scale, zero_point=zp, axis=axis, shape=shape,
            symmetric=_zero_is_symmetric(inits.get(zp or "")), bits=linear_bits(inits[data]),
        )  # fmt: skip
    if node.op_type == "DequantizeLinear":
        data, scale, zp = node.input[0], node.input[1], _optional(node, 2)
        axis = attrs.get("axis", 1) if len(inits[scale].dims) == 1 else None
        shape = list(inits[data].dims) if data in inits else [1]  # gathered rows: see below
        bits = linear_bits(inits[data]) if data in inits else 8
        return data, QuantRef(
            scheme="linear", scale=scale, zero_point=zp, axis=axis, shape=shape,
            symmetric=_zero_is_symmetric(inits.get(zp or "")), bits=bits,
        )  # fmt: skip
    if node.op_type == "MatMulNBits":
        zp = _optional(node, 3)
        return node.input[1], QuantRef(
            scheme="matmul-nbits", scale=node.input[2], zero_point=zp, bits=attrs["bits"],
            block_size=attrs["block_size"], shape=[attrs["K"], attrs["N"]], symmetric=zp is None,
        )  # fmt: skip
    data, zp = node.input[0], _optional(node, 3)
    return data, QuantRef(
        scheme="gather-block", scale=node.input[2], zero_point=zp,
        axis=attrs.get("quantize_axis", 1), bits=attrs.get("bits", 4),
        block_size=attrs.get("block_size", 128), shape=list(inits[data].dims), symmetric=zp is None,
    )  # fmt: skip


def linear_bits(data: onnx.TensorProto) -> int:
    """8, or 7 for 8-bit data quantized in ONNX Runtime's reduced range (``reduce_range``:
    int8 in [-64, 64], uint8 in [0, 127]). ``quantize_data`` maps a tensor's (or channel's)
    largest magnitude to the range's end, so a full-range tensor always holds a value past
    the reduced one; an all-zero tensor counts as reduced (what fedshard's int8 writes)."""
    q = numpy_helper.to_array(data)
    if q.dtype == np.int8:
        return 7 if int(np.abs(q.astype(np.int16)).max(initial=0)) <= REDUCED_INT8_MAX else 8
    if q.dtype == np.uint8:
        return 7 if int(q.max(initial=0)) <= REDUCED_UINT8_MAX else 8
    return 8


def quantized_weights(model: onnx.ModelProto) -> dict[str, QuantRef]:
    """Every quantized weight of ``model`` by the name of the initializer holding its data."""
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, QuantRef] = {}
    readers = {
        "MatMulInteger": 1, "MatMulNBits": 1, "DequantizeLinear": 0, "GatherBlockQuantized": 0,
    }  # fmt: skip
    for node in model.graph.node:
        slot = readers.get(node.op_type)
        if slot is None or len(node.input) <= slot or node.input[slot] not in inits:
            continue
        name, ref = _ref_of(node, inits)
        out.setdefault(name, ref)
    out.update(_gathered_tables(model, inits))
    return out


def _gathered_tables(
    model: onnx.ModelProto, inits: Mapping[str, onnx.TensorProto]
) -> dict[str, QuantRef]:
    """``quantize_dynamic``'s embedding: ``Gather`` of an int8 table, then ``DequantizeLinear``
    of the gathered rows (the table's scale and zero point are that node's)."""
    dq = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for node in model.graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" else None
        after = dq.get(node.output[0])
        if table is None or after is None or table.data_type == onnx.TensorProto.FLOAT:
            continue
        _, ref = _ref_of(after, inits)
        if ref.axis is not None:
            raise GraphError(f"{table.name}: a per-channel gathered table is not supported")
        out[table.name] = ref.model_copy(update={"shape": list(table.dims)})
    return out


def dequantized(ref: QuantRef, data: str, inits: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """The float32 weight that ``data`` (quantized as ``ref``) holds."""
    zp = inits[ref.zero_point] if ref.zero_point else None
    return dequantize(
        ref,
        numpy_helper.to_array(inits[data]),
        numpy_helper.to_array(inits[ref.scale]),
        None if zp is None else numpy_helper.to_array(zp),
    )


def requantized(
    ref: QuantRef, data: str, weight: np.ndarray, inits: Mapping[str, onnx.TensorProto]
) -> dict[str, np.ndarray]:
    """Initializer name -> array for ``weight`` (float, ``ref.shape``) quantized as ``ref``
    (the served ``data`` initializer's type and layout), by ONNX Runtime's quantizers."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if list(weight.shape) != ref.shape:
        raise GraphError(f"{data}: weight {list(weight.shape)} != {ref.shape}")
    if ref.scheme == "linear":
        q, scale, zp = _linear(ref, weight, inits[data].data_type)
    elif ref.scheme == "matmul-nbits":
        q, scale, zp = _nbits(ref, weight)
    else:
        raise GraphError(f"{data}: re-quantizing a {ref.scheme} table is not supported")
    out = {data: q.reshape(inits[data].dims), ref.scale: scale.reshape(inits[ref.scale].dims)}
    if ref.zero_point:
        out[ref.zero_point] = zp.reshape(inits[ref.zero_point].dims)
    return out


def _linear(ref: QuantRef, weight: np.ndarray, qtype: int) -> tuple[np.ndarray, ...]:
    """``quantize_dynamic``'s weight quantization: ``quantize_data`` per channel (or tensor)."""
    from onnxruntime.quantization.quant_utils import quantize_data

    reduced = ref.bits == 7
    if ref.axis is None:
        zp, scale, q = quantize_data(weight.flatten(), qtype, ref.symmetric, reduce_range=reduced)
        return np.asarray(q), np.asarray(scale, np.float32), np.asarray(zp)
    channels = [
        quantize_data(weight.take(i, ref.axis).flatten(), qtype, ref.symmetric, reduced)
        for i in range(weight.shape[ref.axis])
    ]
    view = list(weight.shape)
    view[ref.axis] = 1
    q = np.concatenate([np.asarray(c[2]).reshape(view) for c in channels], axis=ref.axis)
    scale = np.array([np.asarray(c[1]).item() for c in channels], np.float32)
    zp = np.array([np.asarray(c[0]).item() for c in channels]).astype(q.dtype)
    return q, scale, zp


def _nbits(ref: QuantRef, weight: np.ndarray) -> tuple[np.ndarray, ...]:
    """``MatMulNBitsQuantizer``'s block quantization of a ``[K, N]`` weight."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    config = DefaultWeightOnlyQuantConfig(
        block_size=ref.block_size or 32, is_symmetric=ref.symmetric, bits=ref.bits,
        quant_format=QuantFormat.QOperator,
    )  # fmt: skip
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    return packed, scales, zero_points
