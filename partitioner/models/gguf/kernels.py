"""GGUF tensors onto ONNX Runtime's own CPU kernels, per tensor, in the file's quantization.

``--weights keep`` (exact weights; ``x`` float32 in, float32 out). ``MatMulNBits`` runs at
:data:`ACCURACY_LEVEL` 4: ONNX Runtime quantizes the activations to int8 per row and block
inside the kernel, as llama.cpp does (Q8_0/Q8_K activations); the weights stay exact.

============  ===================================  =========================================
type          ``matmul``                           ``gather`` (embedding rows)
============  ===================================  =========================================
Q4_0          MatMulNBits 4-bit b32                GatherBlockQuantized uint8 4-bit b32
Q4_1, Q4_K    MatMulNBits 4-bit b32 + min term     GBQ uint8 8-bit b32 + gathered mins
Q5_0          MatMulNBits 8-bit b32 (widened)      GBQ uint8 8-bit b32
Q5_1, Q5_K    MatMulNBits 8-bit b32 + min term     GBQ uint8 8-bit b32 + gathered mins
Q8_0          MatMulNBits 8-bit b32                GBQ uint8 8-bit b32
Q6_K          MatMulNBits 8-bit b16 (widened)      GBQ uint8 8-bit b16
Q3_K          MatMulNBits 8-bit b16 (widened)      GBQ uint8 4-bit b16
Q2_K          MatMulNBits 8-bit b16 + min term     GBQ uint8 4-bit b16 + gathered mins
IQ4_NL/XS,    MatMulNBits 8-bit b32 (grid value    GBQ uint8 8-bit b32
IQ3_XXS/S,    times sign; IQ1_S: 8 * (grid +-
IQ2_XXS,      1/8) under scale / 8)
IQ1_S
IQ2_XS/S,     MatMulNBits 8-bit b16 (as above)     GBQ uint8 8-bit b16
IQ1_M
F32           MatMul, float32 [K, N] (2+ rows)     Gather float32
F16, BF16     Cast(F16/BF16 [K, N]), MatMul        Gather F16/BF16, Cast
other         :class:`UnsupportedTensorType`       :class:`UnsupportedTensorType`
============  ===================================  =========================================

"Other" (TQ1_0, TQ2_0, MXFP4, NVFP4, integer types) is refused in ``keep`` mode before anything
is built; ``int4``/``int8`` re-quantize whatever gguf-py dequantizes.

"Min term": Q4_1/Q5_1/Q2_K/Q4_K/Q5_K add a per-block constant ``low`` (``m``, ``-dmin*m``).
``MatMulNBits`` keeps the scale with its default zero point (a float zero point would be exact
but stops ONNX Runtime from pre-packing: about 40x slower), and the constant part goes into a
small product ``ReduceSum(x per block) @ C``, ``C`` of ``K / block`` rows. That product runs on
its rows stacked twice, so one row is computed by the same GEMM kernel as several.

Measured (ONNX Runtime 1.32, AVX-512, ``tests/partitioner/test_gguf_kernels.py`` and
``bench/gguf_kernels.py``, whose table is ``bench/results/gguf_kernels.md``):

- exactness: against ``x @ dequantize(W).T`` in float64, relative to ``|x| |w_row|``, at most
  1.1e-7 at accuracy level 0 for every type; 4.6e-4 to 1.3e-3 at level 4 (int8 activations);
  gathers are bit for bit ``gguf.quants.dequantize``'s rows;
- rows: at level 4 a k-row pass gives bit for bit the rows of k one-row passes for every type
  (1 and 2 threads; float MatMul too at the shapes tried); at level 0 it does not;
- speed, one thread, one row at 4096 x 4096 against int4 b32: Q4_0 0.96x, Q4_K 1.15x, Q4_1
  1.3x, Q8_0/Q5_0 1.5x, Q5_K/Q6_K 2.1x, Q2_K 2.8x, float 10x; 64 rows: 0.87x-1.08x (float
  1.5x). 8-bit at level 0 takes ~100 ms against ~0.6 ms at level 4;
- memory per weight (:func:`stored_bytes`; held as measured on a session loaded from external
  data within 0.5 bit): 4-bit b32 6 bits, 8-bit b32 10, 8-bit b16 12, plus 1 bit for a b32 min
  term (2 for b16). F16/BF16 weights: ONNX Runtime folds the Cast at load into a float32
  initializer (32 bits held, F32's speed; the segment file holds 16). Embeddings: 4 or 8 bits
  per code plus a float scale (and min) per block; F16/BF16 16 bits, F32 32.

Names: a part's initializers are ``{name}.…``, its nodes and inner tensors ``{name}/…`` and its
output ``{name}/out``, so parts of distinct names never collide; small int64 constants (shapes,
axes) are ``Constant`` nodes, never initializers that could go to external data.

``--weights int4|int8`` re-quantizes every weight (any type gguf-py dequantizes, IQ* included)
with ONNX Runtime's own block quantizer: :mod:`partitioner.models.gguf.kernels_requant`.
"""

from __future__ import annotations

import numpy as np
import onnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from onnx import TensorProto, helper, numpy_helper

from partitioner.errors import GraphError
from partitioner.models.gguf.kernels_codes import (
    FLOAT_TYPES,
    LAYOUTS,
    MS_DOMAIN,
    Codes,
    GraphPart,
    UnsupportedTensorType,
    WeightsMode,
    array_tensor,
    decode_stored,
    default_zero_shift,
    float_rows,
    float_tensor,
    float_values,
    int64_constant,
    layout,
    two_row_matmul,
)
from partitioner.models.gguf.kernels_gather import gather_bits, streamed_gather
from partitioner.models.gguf.kernels_iq import IQ_SCALES
from partitioner.models.gguf.kernels_requant import requantized_gather, requantized_matmul

__all__ = [
    "ACCURACY_LEVEL",
    "GraphPart",
    "UnsupportedTensorType",
    "WeightsMode",
    "dequantize",
    "gather",
    "matmul",
    "stored_bytes",
]

T = GGMLQuantizationType
ACCURACY_LEVEL = 4
"""``MatMulNBits``' ``accuracy_level``: 4 (int8 activations) is ONNX Runtime's fast CPU path;
8-bit weights have no other fast path (113 ms against ~2 ms at 4096 x 4096, NOTES.md)."""
MATMUL_BITS: dict[GGMLQuantizationType, int] = {
    T.Q4_0: 4,
    T.Q4_1: 4,
    T.Q4_K: 4,
    T.Q5_0: 8,
    T.Q5_1: 8,
    T.Q5_K: 8,
    T.Q8_0: 8,
    T.Q6_K: 8,
    T.Q3_K: 8,
    T.Q2_K: 8,
    T.IQ4_NL: 8,
    T.IQ4_XS: 8,
    **dict.fromkeys(IQ_SCALES, 8),
}
"""``MatMulNBits`` bits per type (block: the type's sub-block, 32 or 16)."""


def _check_type(ggml_type: GGMLQuantizationType, weights: WeightsMode) -> None:
    if ggml_type in FLOAT_TYPES or ggml_type in LAYOUTS:
        return
    if weights != "keep" and ggml_type in GGML_QUANT_SIZES:
        return
    raise UnsupportedTensorType(
        ggml_type, "not kept exactly here; --weights int4 or int8 re-quantizes it"
    )


def dequantize(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> np.ndarray:
    """Float32 values in the logical ``shape`` (``gguf.quants.dequantize`` underneath).

    ``raw`` is the tensor's data as ``GGUFReader`` gives it (uint8 blocks, or a float array).
    """
    if ggml_type not in FLOAT_TYPES and ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedTensorType(ggml_type, "gguf-py cannot dequantize it")
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return float_rows(raw, ggml_type, 0, rows, cols).reshape(shape)


def matmul(
    name: str,
    x: str,
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    n_out: int,
    n_in: int,
    weights: WeightsMode = "keep",
    *,
    accuracy_level: int = ACCURACY_LEVEL,
) -> GraphPart:
    """``y[..., n_out] = x[..., n_in] @ W.T`` for the GGUF weight ``W`` ``[n_out, n_in]``.

    GGUF lists dims reversed (``ne0 = n_in``); ``raw`` is the tensor's bytes as ``GGUFReader``
    gives them (uint8 blocks, or the float array for F32/F16/BF16). Float32 in and out. Which
    kernel each type gets is in the module docstring; ``accuracy_level`` 0 makes
    ``MatMulNBits`` compute on float activations (exact to float rounding, and slow).
    :class:`UnsupportedTensorType` before anything is built for a type without a mapping.
    """
    _check_type(ggml_type, weights)
    if weights != "keep":
        return requantized_matmul(name, x, raw, ggml_type, n_out, n_in, weights)
    if ggml_type in FLOAT_TYPES:
        return _float_matmul(name, x, raw, ggml_type, n_out, n_in)
    return _streamed_nbits_matmul(name, x, raw, ggml_type, n_out, n_in, accuracy_level)


def _streamed_nbits_matmul(
    name: str,
    x: str,
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    n_out: int,
    n_in: int,
    accuracy_level: int,
) -> GraphPart:
    """:func:`nbits_matmul` of ``decode(raw)``, its codes stored chunk by chunk straight into
    the packed initializer (about 1x the stored bytes besides it, instead of the codes, a
    packed copy and its temporaries)."""
    lay = layout(ggml_type)
    bits = MATMUL_BITS[ggml_type]
    shift = default_zero_shift(lay, bits)
    if shift is None and lay.code_bits > bits:
        raise GraphError(f"{lay.code_bits}-bit codes do not fit {bits}-bit MatMulNBits")
    done = decode_stored(raw, ggml_type, n_out, n_in, shift or 0, bits)
    blocks = n_in // lay.block
    holder = [done.stored.reshape(n_out, blocks, -1)]
    scales, low = done.scales, done.lows
    del done
    packed = array_tensor(f"{name}.qweight", holder)
    scale_tensor = numpy_helper.from_array(scales, f"{name}.scales")
    if shift is None:
        shifted = np.float32((1 << (bits - 1)) - lay.zero) * scales
        low = shifted if low is None else shifted + low
    return _nbits_part(
        name, x, packed, scale_tensor, low, n_out, n_in, bits, lay.block, accuracy_level
    )


def _float_matmul(
    name: str, x: str, raw: np.ndarray, ggml_type: GGMLQuantizationType, n_out: int, n_in: int
) -> GraphPart:
    values = float_values(raw, ggml_type).reshape(n_out, n_in)
    weight = float_tensor(f"{name}.weight", np.ascontiguousarray(values.T), ggml_type)
    out = f"{name}/out"
    if ggml_type == T.F32:
        return GraphPart(tuple(two_row_matmul(name, x, weight.name, out)), (weight,), out)
    cast = helper.make_node(
        "Cast", [weight.name], [f"{name}/w32"], f"{name}/Cast", to=TensorProto.FLOAT
    )
    return GraphPart((cast, *two_row_matmul(name, x, f"{name}/w32", out)), (weight,), out)


def nbits_matmul(name: str, x: str, codes: Codes, bits: int, accuracy_level: int) -> GraphPart:
    """``MatMulNBits`` (default zero point, no zero-point input) on ``codes``, plus the
    min-term product where the codes need one (see the module docstring)."""
    lay = codes.layout
    n_out, n_in = codes.codes.shape
    stored, const = _stored_codes(codes, bits)
    if bits == 4:
        stored = stored[:, 0::2] | (stored[:, 1::2] << np.uint8(4))
    blocks = n_in // lay.block
    packed = numpy_helper.from_array(stored.reshape(n_out, blocks, -1), f"{name}.qweight")
    scales = numpy_helper.from_array(codes.scales, f"{name}.scales")
    low = codes.lows
    if const is not None:
        shifted = np.float32(const) * codes.scales
        low = shifted if low is None else shifted + low
    return _nbits_part(name, x, packed, scales, low, n_out, n_in, bits, lay.block, accuracy_level)


def _nbits_part(
    name: str,
    x: str,
    packed: TensorProto,
    scales: TensorProto,
    low: np.ndarray | None,
    n_out: int,
    n_in: int,
    bits: int,
    block: int,
    accuracy_level: int,
) -> GraphPart:
    base = f"{name}/out" if low is None else f"{name}/nbits"
    node = helper.make_node(
        "MatMulNBits",
        [x, packed.name, scales.name],
        [base],
        f"{name}/MatMulNBits",
        domain=MS_DOMAIN,
        K=n_in,
        N=n_out,
        bits=bits,
        block_size=block,
        accuracy_level=accuracy_level,
    )
    if low is None:
        return GraphPart((node,), (packed, scales), base)
    nodes, inits = min_term(name, x, base, low, block)
    return GraphPart((node, *nodes), (packed, scales, *inits), f"{name}/out")


def _stored_codes(codes: Codes, bits: int) -> tuple[np.ndarray, int | None]:
    """Codes as ``MatMulNBits`` stores them under its default zero point ``2**(bits-1)``, and
    the integer ``c`` (or None) such that ``c * scale`` per block must be added back. Shifts
    ``codes.codes`` in place (one tensor's codes exist once)."""
    lay = codes.layout
    shift = default_zero_shift(lay, bits)
    if shift is not None:
        if shift:
            np.add(codes.codes, np.uint8(shift), out=codes.codes)
        return codes.codes, None
    if lay.code_bits > bits:
        raise GraphError(f"{lay.code_bits}-bit codes do not fit {bits}-bit MatMulNBits")
    return codes.codes, (1 << (bits - 1)) - lay.zero


def min_term(
    name: str, x: str, y: str, low: np.ndarray, block: int
) -> tuple[list[onnx.NodeProto], list[TensorProto]]:
    """Nodes adding ``sum_b (sum of x over block b) * low[n, b]`` to ``y`` as ``{name}/out``.

    ``low`` is float32 ``[N, K / block]``. The block sums' product runs on its rows stacked
    twice, then keeps the first half, so every row goes through ONNX Runtime's GEMM kernel
    (a lone row would take its matrix-vector kernel, which adds in another order).
    """
    blocks = low.shape[1]
    p = f"{name}/min"
    table = numpy_helper.from_array(np.ascontiguousarray(low.T), f"{name}.min_term")
    shape = int64_constant(f"{p}/block_shape", [-1, blocks, block])
    axes = int64_constant(f"{p}/sum_axes", [2])
    zero = int64_constant(f"{p}/zero", [0])
    nodes = [
        shape,
        axes,
        zero,
        helper.make_node("Reshape", [x, shape.output[0]], [f"{p}/blocks"], f"{p}/Reshape"),
        helper.make_node(
            "ReduceSum",
            [f"{p}/blocks", axes.output[0]],
            [f"{p}/sums"],
            f"{p}/ReduceSum",
            keepdims=0,
        ),
        helper.make_node(
            "Concat", [f"{p}/sums", f"{p}/sums"], [f"{p}/twice"], f"{p}/Concat", axis=0
        ),
        helper.make_node("MatMul", [f"{p}/twice", table.name], [f"{p}/prod2"], f"{p}/MatMul"),
        helper.make_node("Shape", [f"{p}/sums"], [f"{p}/rows"], f"{p}/Rows", start=0, end=1),
        helper.make_node(
            "Slice",
            [f"{p}/prod2", zero.output[0], f"{p}/rows", zero.output[0]],
            [f"{p}/prod"],
            f"{p}/Slice",
        ),
        helper.make_node("Shape", [y], [f"{p}/yshape"], f"{p}/YShape"),
        helper.make_node("Reshape", [f"{p}/prod", f"{p}/yshape"], [f"{p}/term"], f"{p}/Back"),
        helper.make_node("Add", [y, f"{p}/term"], [f"{name}/out"], f"{p}/Add"),
    ]
    return nodes, [table]


def gather(
    name: str,
    ids: str,
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    n_rows: int,
    n_cols: int,
    weights: WeightsMode = "keep",
) -> GraphPart:
    """Embedding rows ``[..., n_cols]`` float32 for int64 ``ids`` (module docstring: which
    op per type). In ``keep`` mode the rows are bit for bit ``gguf.quants.dequantize``'s."""
    _check_type(ggml_type, weights)
    if weights != "keep":
        return requantized_gather(name, ids, raw, ggml_type, n_rows, n_cols, weights)
    if ggml_type in FLOAT_TYPES:
        values = float_values(raw, ggml_type).reshape(n_rows, n_cols)
        table = float_tensor(f"{name}.table", values, ggml_type)
        out = f"{name}/out"
        if ggml_type == T.F32:
            return GraphPart(
                (helper.make_node("Gather", [table.name, ids], [out], f"{name}/Gather"),),
                (table,),
                out,
            )
        nodes = (
            helper.make_node("Gather", [table.name, ids], [f"{name}/rows"], f"{name}/Gather"),
            helper.make_node("Cast", [f"{name}/rows"], [out], f"{name}/Cast", to=TensorProto.FLOAT),
        )
        return GraphPart(nodes, (table,), out)
    return streamed_gather(name, ids, raw, ggml_type, n_rows, n_cols)


def stored_bytes(
    ggml_type: GGMLQuantizationType,
    n_out: int,
    n_in: int,
    weights: WeightsMode = "keep",
    *,
    embedding: bool = False,
) -> int:
    """Bytes ONNX Runtime holds for this weight once mapped (for the unit table and planning).

    ``MatMulNBits`` as ONNX Runtime pre-packs it at accuracy level 4: the codes, a float32 scale
    and a float32 block sum per block, plus the min-term table (what a session loaded from
    external data was measured to add, within 0.5 bit per weight: 4-bit b32 6 bits, 8-bit b32
    10, 8-bit b16 12). ``embedding``: the gather's tables instead (codes, scales, mins).
    """
    _check_type(ggml_type, weights)
    count = n_out * n_in
    if weights != "keep":
        bits = 4 if weights == "int4" else 8
        blocks = n_out * -(-n_in // 32)
        per_block = 4 + (0 if embedding else 4)  # a scale, and a block sum where pre-packed
        return count * bits // 8 + blocks * per_block + blocks * bits // 8  # + zero points
    if ggml_type in FLOAT_TYPES:
        return count * (2 if embedding and ggml_type != T.F32 else 4)
    lay = layout(ggml_type)
    blocks = n_out * (n_in // lay.block)
    if embedding:
        bits = gather_bits(lay)
        return count * bits // 8 + blocks * (8 if lay.has_low else 4)
    bits = MATMUL_BITS[ggml_type]
    needs_term = lay.has_low or default_zero_shift(lay, bits) is None
    return count * bits // 8 + blocks * 8 + (blocks * 4 if needs_term else 0)
