"""What a :class:`~protocols.lora.QuantRef` means: the float weight of a quantized initializer.

The formats are ONNX Runtime's (``quantize_dynamic``'s int8 weights, ``MatMulNBits``,
``GatherBlockQuantized``); :func:`dequantize` is the arithmetic those kernels do, so a device
trains LoRA adapters over exactly the weights the served graph computes with. Re-quantizing a
merged weight is the partitioner's (with ONNX Runtime's own quantizers); this module only
reads.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from protocols.errors import SchemaError
from protocols.lora import QuantRef


def dequantize(
    ref: QuantRef, data: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike | None
) -> npt.NDArray[np.float32]:
    """The float32 weight of ``ref``, shaped ``ref.shape`` (the float initializer's layout)."""
    q = np.asarray(data).astype(np.float32)
    s = np.asarray(scale, dtype=np.float32)
    z = None if zero_point is None else np.asarray(zero_point).astype(np.float32)
    if ref.scheme == "linear":
        out = _linear(ref, q, s, z)
    elif ref.scheme == "matmul-nbits":
        out = _matmul_nbits(ref, np.asarray(data, np.uint8), s, zero_point)
    else:
        out = _gather_block(ref, q, s, z)
    if list(out.shape) != ref.shape:
        raise SchemaError(f"dequantized shape {list(out.shape)} != {ref.shape}")
    return out


def _linear(
    ref: QuantRef, q: np.ndarray, s: np.ndarray, z: np.ndarray | None
) -> npt.NDArray[np.float32]:
    z = np.zeros_like(s) if z is None else z
    if ref.axis is not None and s.ndim == 1 and q.ndim > 1:
        view = [1] * q.ndim
        view[ref.axis] = -1
        s, z = s.reshape(view), z.reshape(view)
    out: npt.NDArray[np.float32] = ((q - z) * s).astype(np.float32)
    return out


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Low bits first: byte ``b`` holds values ``b & mask``, ``(b >> bits) & mask``, ..."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = (packed[..., None] >> shifts) & mask
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _matmul_nbits(
    ref: QuantRef, packed: np.ndarray, s: np.ndarray, zero_point: npt.ArrayLike | None
) -> npt.NDArray[np.float32]:
    """``MatMulNBits``' B ``[N, blocks, blob]`` -> the ``[K, N]`` weight it multiplies by."""
    k, n = ref.shape
    block = ref.block_size or 0
    if len(ref.shape) != 2 or block <= 0 or packed.ndim != 3 or packed.shape[0] != n:
        raise SchemaError(f"matmul-nbits weight {list(packed.shape)} does not fit {ref.shape}")
    blocks = packed.shape[1]
    q = _unpack(packed, ref.bits).reshape(n, -1)[:, :k].astype(np.float32)
    scales = s.reshape(n, blocks)
    if zero_point is None:
        zeros = np.full((n, blocks), float(1 << (ref.bits - 1)), np.float32)
    else:
        zp = np.asarray(zero_point, np.uint8).reshape(n, -1)
        zeros = _unpack(zp, ref.bits)[:, :blocks].astype(np.float32)
    per_k = np.arange(k) // block
    weight_t = (q - zeros[:, per_k]) * scales[:, per_k]
    return np.ascontiguousarray(weight_t.T, dtype=np.float32)


def _gather_block(
    ref: QuantRef, q: np.ndarray, s: np.ndarray, z: np.ndarray | None
) -> npt.NDArray[np.float32]:
    """``GatherBlockQuantized``' table: blocks of ``block_size`` along ``axis``."""
    axis, block = ref.axis if ref.axis is not None else 1, ref.block_size or 0
    if q.ndim != 2 or block <= 0:
        raise SchemaError(f"gather-block table {list(q.shape)} is not a blocked matrix")
    z = np.full_like(s, float(1 << (ref.bits - 1))) if z is None else z
    per = np.arange(q.shape[axis]) // block
    if axis == 1:
        out: npt.NDArray[np.float32] = ((q - z[:, per]) * s[:, per]).astype(np.float32)
    else:
        out = ((q - z[per, :]) * s[per, :]).astype(np.float32)
    return out
