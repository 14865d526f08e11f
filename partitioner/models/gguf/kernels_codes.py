"""GGUF quantized blocks as integer codes, per-block scales and per-block mins.

Every block type :mod:`partitioner.models.gguf.kernels` maps decodes, exactly, to

    value[n, k] = (code[n, k] - zero) * scale[n, k // block] (+ low[n, k // block])

with ``code`` an unsigned integer of at most 8 bits, ``zero`` an integer constant of the type,
``scale`` the float32 product ggml itself forms (``d * sc`` of the K-quants) and ``low`` the
float32 per-block "min" term where the type has one (``m`` of Q4_1/Q5_1, ``-dmin * m`` of
Q2_K/Q4_K/Q5_K). Computed in float32 in this order, the values are bit for bit those of
``gguf.quants.dequantize``. IQ4_NL/IQ4_XS map their 16-value grid to codes here; the grid
i-quants come from :mod:`partitioner.models.gguf.kernels_iq`. Layouts follow ggml's
``ggml-common.h`` (and gguf-py's ``quants.py``, which mirrors it). Decoding runs over row
chunks, so the temporaries stay a small multiple of one chunk whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from onnx import TensorProto, helper, numpy_helper

from partitioner.errors import GraphError
from partitioner.models.gguf.kernels_iq import IQ_SCALES
from partitioner.models.gguf.kernels_iq import decoder as iq_decoder

T = GGMLQuantizationType
WeightsMode = Literal["keep", "int4", "int8"]
MS_DOMAIN = "com.microsoft"
FLOAT_TYPES = {T.F32: TensorProto.FLOAT, T.F16: TensorProto.FLOAT16, T.BF16: TensorProto.BFLOAT16}
ROWS_PER_CHUNK = 1024
"""Rows decoded at once; temporaries are about 8 bytes per value of one chunk."""


class UnsupportedTensorType(GraphError):
    """A GGUF tensor type that has no exact ONNX Runtime mapping here; ``ggml_type`` names it."""

    def __init__(self, ggml_type: GGMLQuantizationType, why: str = "") -> None:
        detail = f": {why}" if why else ""
        super().__init__(
            f"GGUF tensor type {ggml_type.name} has no exact ONNX Runtime kernel mapping{detail}"
        )
        self.ggml_type = ggml_type


@dataclass(frozen=True)
class GraphPart:
    """Nodes and initializers that compute one output tensor from graph tensors."""

    nodes: tuple[onnx.NodeProto, ...]
    initializers: tuple[onnx.TensorProto, ...]
    output: str


def int64_constant(name: str, values: list[int]) -> onnx.NodeProto:
    """A ``Constant`` node for a small int64 vector (a shape, axes): never external data,
    which ONNX Runtime's shape inference cannot read."""
    tensor = numpy_helper.from_array(np.array(values, np.int64), name)
    return helper.make_node("Constant", [], [name], f"{name}/Constant", value=tensor)


def at_least_two_rows(name: str, x: str) -> tuple[list[onnx.NodeProto], str, str]:
    """Nodes making ``x`` (rows on axis -2) at least two rows: stacked twice and cut to
    ``max(rows, 2)``, so a product on it runs ONNX Runtime's GEMM kernel and never its one-row
    kernel (which adds in another order). Returns the nodes, the padded tensor
    ``{name}/padded`` and ``{name}/rows`` (``x``'s own row count, to cut the result back
    with :func:`first_rows`)."""
    mk = helper.make_node
    nodes = [
        mk("Concat", [x, x], [f"{name}/stacked"], f"{name}/Concat", axis=-2),
        mk("Shape", [x], [f"{name}/rows"], f"{name}/Shape", start=-2, end=-1),
        int64_constant(f"{name}/two", [2]),
        mk("Max", [f"{name}/rows", f"{name}/two"], [f"{name}/taken"], f"{name}/Max"),
        int64_constant(f"{name}/zero", [0]),
        int64_constant(f"{name}/axis", [-2]),
        mk("Slice", [f"{name}/stacked", f"{name}/zero", f"{name}/taken", f"{name}/axis"],
           [f"{name}/padded"], f"{name}/Slice"),
    ]  # fmt: skip
    return nodes, f"{name}/padded", f"{name}/rows"


def first_rows(name: str, x: str, rows: str, out: str) -> onnx.NodeProto:
    """``Slice`` of the first ``rows`` rows (axis -2) of ``x`` into ``out`` (the constants of
    :func:`at_least_two_rows` of the same ``name``)."""
    return helper.make_node(
        "Slice", [x, f"{name}/zero", rows, f"{name}/axis"], [out], f"{name}/Back"
    )


def two_row_matmul(name: str, x: str, weight: str, out: str) -> list[onnx.NodeProto]:
    """``x @ weight`` into ``out``, computed on at least two rows of ``x``
    (:func:`at_least_two_rows`): a one-token step then adds as a pass of several does."""
    nodes, padded, rows = at_least_two_rows(f"{name}/rows2", x)
    product = f"{name}/product"
    nodes.append(helper.make_node("MatMul", [padded, weight], [product], f"{name}/MatMul"))
    nodes.append(first_rows(f"{name}/rows2", product, rows, out))
    return nodes


def float_values(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """F32/F16 data as numpy floats, BF16 as its uint16 bit patterns (flat or as given)."""
    dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[ggml_type]
    data = np.ascontiguousarray(raw)
    if data.dtype == dtype:
        return data
    if data.dtype in (np.uint8, np.int8):
        return data.reshape(-1).view(dtype)
    if ggml_type == T.BF16:
        raise GraphError(f"BF16 data given as {data.dtype}, expected its raw bytes")
    return data.astype(dtype)


def float_tensor(name: str, values: np.ndarray, ggml_type: GGMLQuantizationType) -> TensorProto:
    """An initializer of ``values`` in ``ggml_type``'s float type (BF16 from bit patterns)."""
    if ggml_type == T.BF16:
        return helper.make_tensor(
            name, TensorProto.BFLOAT16, values.shape, values.tobytes(), raw=True
        )
    return numpy_helper.from_array(values, name)


def float_rows(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, start: int, stop: int, cols: int
) -> np.ndarray:
    """Float32 rows ``[start, stop)`` of a ``[rows, cols]`` tensor of any type gguf-py reads."""
    if ggml_type in FLOAT_TYPES:
        vals = float_values(raw, ggml_type).reshape(-1, cols)[start:stop]
        if ggml_type == T.BF16:
            return (vals.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return vals.astype(np.float32)
    values, nbytes = GGML_QUANT_SIZES[ggml_type]
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    row_bytes = cols // values * nbytes
    part = data[start * row_bytes : stop * row_bytes].reshape(stop - start, row_bytes)
    result: np.ndarray = gguf_dequantize(part, ggml_type).astype(np.float32, copy=False)
    return result.reshape(stop - start, cols)


@dataclass(frozen=True)
class Layout:
    """What one block type decodes to: ``block`` values share a scale; codes lie in
    ``[0, 2**code_bits)``; ``zero`` is subtracted; ``has_low`` says whether a min term exists."""

    block: int
    code_bits: int
    zero: int
    has_low: bool


@dataclass(frozen=True)
class Codes:
    """A weight ``[rows, cols]`` decoded: ``codes`` uint8 ``[rows, cols]``, ``scales`` and
    ``lows`` (or None) float32 ``[rows, cols // layout.block]``."""

    layout: Layout
    codes: np.ndarray
    scales: np.ndarray
    lows: np.ndarray | None


_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]
"""One chunk: codes [n_blocks, values], scales [n_blocks, subs], lows or None."""


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """Low nibbles of each ``group`` bytes, then their high nibbles (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, n_values: int) -> np.ndarray:
    """Bit ``j`` of a block's little-endian bit field, for ``j < n_values`` (Q5_0/Q5_1)."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits[:, :n_values]


def _q4_0(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> _Decoded:
    codes = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
    return codes, _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> _Decoded:
    codes = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
    return codes, _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> _Decoded:
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of Q4_K/Q5_K's 12 packed bytes (``get_scale_k4``)."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8).astype(np.float32), mn.reshape(n, 8).astype(np.float32)


def _q2_k(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = ((qs.reshape(n, 2, 1, 32) >> shift) & np.uint8(3)).reshape(n, 256)
    scales = d * (sc & 0x0F).astype(np.float32)
    return codes, scales, -(dmin * (sc >> 4).astype(np.float32))


def _q3_k(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(
        n, 16
    )
    high = (
        packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    ).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.float32) - np.float32(32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = ql.reshape(n, 256) | (qh.reshape(n, 256) << np.uint8(2))
    return codes, d * sc, None


def _q4_k(b: np.ndarray) -> _Decoded:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:], 32), d * sc, -(dmin * mn)


def _q5_k(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = _nibbles(b[:, 48:], 32) | (qh.reshape(n, 256) << np.uint8(4))
    return codes, d * sc, -(dmin * mn)


def _q6_k(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = _nibbles(ql, 64)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return low | (high.reshape(n, 256) << np.uint8(4)), d * sc, None


IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16
)
"""``kvalues_iq4nl``: the non-linear 4-bit grid of IQ4_NL/IQ4_XS (ggml-common.h)."""
IQ4_CODES = (IQ4_VALUES + 128).astype(np.uint8)
"""The grid as unsigned 8-bit codes under zero point 128."""


def _iq4_nl(b: np.ndarray) -> _Decoded:
    return IQ4_CODES[_nibbles(b[:, 2:], 16)], _f16(b[:, :2]), None


def _iq4_xs(b: np.ndarray) -> _Decoded:
    n = b.shape[0]
    d = _f16(b[:, :2])
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1)
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)) & np.uint16(3)
    low = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)) & 0x0F
    sc = (low.reshape(n, 8) | (high.astype(np.uint8) << np.uint8(4))).astype(np.float32) - 32
    return IQ4_CODES[_nibbles(b[:, 8:], 16)], d * sc, None


LAYOUTS: dict[GGMLQuantizationType, tuple[Layout, Callable[[np.ndarray], _Decoded]]] = {
    T.Q4_0: (Layout(32, 4, 8, False), _q4_0),
    T.Q4_1: (Layout(32, 4, 0, True), _q4_1),
    T.Q5_0: (Layout(32, 5, 16, False), _q5_0),
    T.Q5_1: (Layout(32, 5, 0, True), _q5_1),
    T.Q8_0: (Layout(32, 8, 128, False), _q8_0),
    T.Q2_K: (Layout(16, 2, 0, True), _q2_k),
    T.Q3_K: (Layout(16, 3, 4, False), _q3_k),
    T.Q4_K: (Layout(32, 4, 0, True), _q4_k),
    T.Q5_K: (Layout(32, 5, 0, True), _q5_k),
    T.Q6_K: (Layout(16, 6, 32, False), _q6_k),
    T.IQ4_NL: (Layout(32, 8, 128, False), _iq4_nl),
    T.IQ4_XS: (Layout(32, 8, 128, False), _iq4_xs),
}
LAYOUTS.update(
    {t: (Layout(block, 8, 128, False), iq_decoder(t)) for t, (block, _) in IQ_SCALES.items()}
)
"""Block types decoded to codes (the quantized types :mod:`kernels` maps)."""


def default_zero_shift(lay: Layout, bits: int) -> int | None:
    """The shift that stores ``lay``'s codes in ``bits`` bits under ONNX Runtime's default zero
    point ``2**(bits-1)`` (stored - default == code - zero), or None where they do not fit."""
    shift = (1 << (bits - 1)) - lay.zero
    fits = shift >= 0 and (1 << lay.code_bits) - 1 + shift < (1 << bits)
    return shift if fits else None


def layout(ggml_type: GGMLQuantizationType) -> Layout:
    """The decoded layout of ``ggml_type``; :class:`UnsupportedTensorType` if it has none."""
    entry = LAYOUTS.get(ggml_type)
    if entry is None:
        raise UnsupportedTensorType(ggml_type)
    return entry[0]


def block_rows(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, cols: int
) -> np.ndarray:
    """``raw`` as uint8 ``[rows, bytes per row]``; :class:`GraphError` on a size mismatch."""
    values, nbytes = GGML_QUANT_SIZES[ggml_type]
    if cols % values:
        raise GraphError(f"{ggml_type.name} rows of {cols} values are not whole {values}-blocks")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    row_bytes = cols // values * nbytes
    if data.size != rows * row_bytes:
        raise GraphError(
            f"{ggml_type.name} tensor [{rows}, {cols}] needs {rows * row_bytes} bytes, "
            f"got {data.size}"
        )
    return data.reshape(rows, row_bytes)


def decode(raw: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, cols: int) -> Codes:
    """Decode a ``[rows, cols]`` tensor of ``ggml_type`` blocks (see the module docstring)."""
    lay = layout(ggml_type)
    decoder = LAYOUTS[ggml_type][1]
    nbytes = GGML_QUANT_SIZES[ggml_type][1]
    data = block_rows(raw, ggml_type, rows, cols)
    codes = np.empty((rows, cols), np.uint8)
    subs = cols // lay.block
    scales = np.empty((rows, subs), np.float32)
    lows = np.empty((rows, subs), np.float32) if lay.has_low else None
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(rows, start + ROWS_PER_CHUNK)
        blocks = data[start:stop].reshape(-1, nbytes)
        c, s, low = decoder(blocks)
        codes[start:stop] = c.reshape(stop - start, cols)
        scales[start:stop] = s.reshape(stop - start, subs)
        if lows is not None and low is not None:
            lows[start:stop] = low.reshape(stop - start, subs)
    return Codes(lay, codes, scales, lows)


def values(decoded: Codes) -> np.ndarray:
    """Float32 ``[rows, cols]`` from ``decoded``, bit for bit as ``gguf.quants.dequantize``."""
    lay = decoded.layout
    rows, cols = decoded.codes.shape
    q = decoded.codes.reshape(rows, -1, lay.block).astype(np.float32) - np.float32(lay.zero)
    out = decoded.scales[..., None] * q
    if decoded.lows is not None:
        out += decoded.lows[..., None]
    result: np.ndarray = out.reshape(rows, cols)
    return result


@dataclass(frozen=True)
class StoredCodes:
    """A weight's codes as an ONNX Runtime kernel stores them: ``stored`` uint8 ``[rows,
    cols * bits // 8]`` (``(code + shift) mod 256``, two 4-bit codes a byte, low nibble first,
    when ``bits`` is 4), with ``scales`` and ``lows`` as in :class:`Codes`."""

    layout: Layout
    stored: np.ndarray
    scales: np.ndarray
    lows: np.ndarray | None


def decode_stored(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, rows: int, cols: int, shift: int, bits: int
) -> StoredCodes:
    """:func:`decode`, shifted and packed row chunk by row chunk straight into the output, so
    no full-size code array exists beside it (bit for bit ``decode`` then shift then pack)."""
    lay = layout(ggml_type)
    decoder = LAYOUTS[ggml_type][1]
    nbytes = GGML_QUANT_SIZES[ggml_type][1]
    data = block_rows(raw, ggml_type, rows, cols)
    stored = np.empty((rows, cols * bits // 8), np.uint8)
    subs = cols // lay.block
    scales = np.empty((rows, subs), np.float32)
    lows = np.empty((rows, subs), np.float32) if lay.has_low else None
    add = np.uint8(shift % 256)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(rows, start + ROWS_PER_CHUNK)
        c, s, low = decoder(data[start:stop].reshape(-1, nbytes))
        c = c.reshape(stop - start, cols)
        if add:
            c = np.add(c, add, dtype=np.uint8)
        if bits == 4:
            np.left_shift(c[:, 1::2], np.uint8(4), out=stored[start:stop])
            stored[start:stop] |= c[:, 0::2]
        else:
            stored[start:stop] = c
        del c
        scales[start:stop] = s.reshape(stop - start, subs)
        if lows is not None and low is not None:
            lows[start:stop] = low.reshape(stop - start, subs)
    return StoredCodes(lay, stored, scales, lows)


def array_tensor(name: str, holder: list[np.ndarray]) -> TensorProto:
    """The initializer of the one array in ``holder`` (emptied: the array is dropped once its
    bytes exist, so the array, its bytes and the protobuf copy never all exist at once)."""
    array = holder.pop()
    dims, dtype = array.shape, helper.np_dtype_to_tensor_dtype(array.dtype)
    data = array.tobytes()
    del array
    tensor = helper.make_tensor(name, dtype, dims, data, raw=True)
    del data
    return tensor
