"""``--weights int4|int8``: a GGUF weight re-quantized with ONNX Runtime's own block quantizer.

Each weight is dequantized (gguf-py, any type it reads) :data:`ROWS_PER_CHUNK` output rows at
a time and quantized by ``quantize_matmul_4bits`` / ``quantize_matmul_8bits`` (the C++ kernels
behind ``MatMulNBitsQuantizer``): blocks of :data:`BLOCK` along the input axis, asymmetric,
uint8 zero points (packed, so ``MatMulNBits`` still pre-packs: a float zero point would not).
Only one chunk of floats exists at a time. Matmuls run at accuracy level 4; embeddings become
a uint8 ``GatherBlockQuantized`` of the same blocks.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from partitioner.errors import GraphError
from partitioner.models.gguf.kernels_codes import (
    MS_DOMAIN,
    GraphPart,
    WeightsMode,
    array_tensor,
    float_rows,
)

BLOCK = 32
ACCURACY_LEVEL = 4
ROWS_PER_CHUNK = 2048


def _bits(weights: WeightsMode) -> int:
    return 4 if weights == "int4" else 8


def blockwise(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, n_out: int, n_in: int, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(packed [n_out, blocks, blob], scales [n_out, blocks], zero points [n_out, zp bytes])``
    of the weight ``[n_out, n_in]`` quantized along ``n_in`` in blocks of :data:`BLOCK`."""
    blocks = -(-n_in // BLOCK)
    per_byte = 8 // bits
    packed = np.empty((n_out, blocks, BLOCK // per_byte), np.uint8)
    scales = np.empty((n_out, blocks), np.float32)
    zeros = np.empty((n_out, -(-blocks // per_byte)), np.uint8)
    quantize = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    for start in range(0, n_out, ROWS_PER_CHUNK):
        stop = min(n_out, start + ROWS_PER_CHUNK)
        rows = float_rows(raw, ggml_type, start, stop, n_in)
        weight = np.zeros((blocks * BLOCK, stop - start), np.float32)
        weight[:n_in] = rows.T
        del rows
        p = np.zeros((stop - start, blocks, BLOCK // per_byte), np.uint8)
        s = np.zeros((stop - start, blocks), np.float32)
        z = np.zeros((stop - start, zeros.shape[1]), np.uint8)
        quantize(p, weight, s, z, BLOCK, stop - start, blocks * BLOCK, False)
        packed[start:stop], scales[start:stop], zeros[start:stop] = p, s, z
    return packed, scales, zeros


def requantized_matmul(
    name: str,
    x: str,
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    n_out: int,
    n_in: int,
    weights: WeightsMode,
) -> GraphPart:
    """``MatMulNBits`` (int4 or int8, block 32, uint8 zero points) computing ``x @ W.T``."""
    bits = _bits(weights)
    packed, scales, zeros = blockwise(raw, ggml_type, n_out, n_in, bits)
    holder = [packed]
    del packed  # the array goes once its bytes exist (array_tensor)
    inits = (
        array_tensor(f"{name}.qweight", holder),
        numpy_helper.from_array(scales, f"{name}.scales"),
        numpy_helper.from_array(zeros, f"{name}.zero_points"),
    )
    node = helper.make_node(
        "MatMulNBits",
        [x, *(t.name for t in inits)],
        [f"{name}/out"],
        f"{name}/MatMulNBits",
        domain=MS_DOMAIN,
        K=n_in,
        N=n_out,
        bits=bits,
        block_size=BLOCK,
        accuracy_level=ACCURACY_LEVEL,
    )
    return GraphPart((node,), inits, f"{name}/out")


def requantized_gather(
    name: str,
    ids: str,
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    n_rows: int,
    n_cols: int,
    weights: WeightsMode,
) -> GraphPart:
    """uint8 ``GatherBlockQuantized`` (4 or 8 bits, block 32) of the re-quantized rows;
    :class:`GraphError` unless ``n_cols`` is whole blocks (a padded row would be gathered)."""
    if n_cols % BLOCK:
        raise GraphError(f"embedding rows of {n_cols} values are not whole {BLOCK}-blocks")
    bits = _bits(weights)
    packed, scales, zeros = blockwise(raw, ggml_type, n_rows, n_cols, bits)
    holder = [packed.reshape(n_rows, -1)]
    del packed  # the array goes once its bytes exist (array_tensor)
    inits = (
        array_tensor(f"{name}.qtable", holder),
        numpy_helper.from_array(scales, f"{name}.scales"),
        numpy_helper.from_array(zeros, f"{name}.zero_points"),
    )
    node = helper.make_node(
        "GatherBlockQuantized",
        [inits[0].name, ids, inits[1].name, inits[2].name],
        [f"{name}/out"],
        f"{name}/GatherBlockQuantized",
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=BLOCK,
        bits=bits,
    )
    return GraphPart((node,), inits, f"{name}/out")
