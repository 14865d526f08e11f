"""The grid-based i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) as 8-bit
codes and per-sub-block scales, exactly.

Each of these types stores, per sub-block of 16 or 32 values, a float scale ``db`` that ggml
forms from the block's f16 ``d`` and a few scale bits, and per value a small signed integer
(a grid entry times a sign: at most 62 in magnitude; IQ1's ``grid + delta`` with ``delta`` =
1/8 becomes the integer ``8 * grid +- 1`` under the scale ``db / 8``). The values are taken
from ``gguf.quants.dequantize`` itself, the codes recovered as ``rint(value / db)``, and every
value is checked to be ``db * code`` bit for bit (else :class:`GraphError`), so these decode to
exactly what gguf-py (and ggml) compute. Layouts from gguf-py's ``quants.py`` (ggml-common.h).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from partitioner.errors import GraphError

T = GGMLQuantizationType
_Decoded = tuple[np.ndarray, np.ndarray, None]


def _d(b: np.ndarray, at: int = 0) -> np.ndarray:
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32)


def _nibble_scales(packed: np.ndarray) -> np.ndarray:
    n = packed.shape[0]
    s = packed.reshape(n, -1, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)
    return (s & 0x0F).reshape(n, -1).astype(np.float32)


def _iq2_xxs(b: np.ndarray) -> np.ndarray:
    high = np.ascontiguousarray(b[:, 2:]).view(np.uint32).reshape(b.shape[0], -1, 2)[..., 1]
    result: np.ndarray = _d(b) * (np.float32(0.5) + (high >> 28).astype(np.float32))
    return result * np.float32(0.25)


def _iq2_xs(b: np.ndarray) -> np.ndarray:
    return _d(b) * (np.float32(0.5) + _nibble_scales(b[:, 66:74])) * np.float32(0.25)


def _iq2_s(b: np.ndarray) -> np.ndarray:
    return _d(b) * (np.float32(0.5) + _nibble_scales(b[:, 74:82])) * np.float32(0.25)


def _iq3_xxs(b: np.ndarray) -> np.ndarray:
    scales = np.ascontiguousarray(b[:, 66:98]).view(np.uint32)
    result: np.ndarray = _d(b) * (np.float32(0.5) + (scales >> 28).astype(np.float32))
    return result * np.float32(0.5)


def _iq3_s(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    s = b[:, 106:110].reshape(n, -1, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)
    result: np.ndarray = _d(b) * (1 + 2 * (s & 0x0F).reshape(n, -1))
    return result


def _iq1_s(b: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16)
    dl: np.ndarray = _d(b) * (2 * ((qh >> 12) & 7) + 1)
    return dl * np.float32(0.125)


def _iq1_m(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = np.ascontiguousarray(b[:, 48:56]).view(np.uint16)
    parts = (scales.reshape(n, 4) & np.uint16(0xF000)) >> np.array(
        [12, 8, 4, 0], np.uint16
    ).reshape(1, 4)
    bits = parts[..., 0] | parts[..., 1] | parts[..., 2] | parts[..., 3]
    d = bits.view(np.float16).astype(np.float32).reshape(n, 1)
    s = (scales.reshape(n, -1, 1) >> np.array([0, 3, 6, 9], np.uint16).reshape(1, 1, 4)) & 7
    dl: np.ndarray = d * (2 * s.reshape(n, -1) + 1)
    return dl * np.float32(0.125)


IQ_SCALES: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    T.IQ2_XXS: (32, _iq2_xxs),
    T.IQ2_XS: (16, _iq2_xs),
    T.IQ2_S: (16, _iq2_s),
    T.IQ3_XXS: (32, _iq3_xxs),
    T.IQ3_S: (32, _iq3_s),
    T.IQ1_S: (32, _iq1_s),
    T.IQ1_M: (16, _iq1_m),
}
"""Per type: the sub-block size and the function giving each block's sub-block scales."""


def decoder(ggml_type: GGMLQuantizationType) -> Callable[[np.ndarray], _Decoded]:
    """The block decoder of a grid i-quant: codes (uint8 under zero point 128) and scales."""
    block, scales_of = IQ_SCALES[ggml_type]

    def decode(blocks: np.ndarray) -> _Decoded:
        n = blocks.shape[0]
        values = gguf_dequantize(blocks, ggml_type).reshape(n, -1, block)
        db = scales_of(blocks).astype(np.float32).reshape(n, -1, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            codes = np.where(db == 0, 0, np.rint(values / db))
        exact = (db * codes.astype(np.float32) == values) | (db == 0) | np.isnan(values)
        if not exact.all() or np.abs(codes).max(initial=0) > 127:
            raise GraphError(f"{ggml_type.name} blocks are not integer multiples of their scales")
        return (codes + 128).astype(np.uint8).reshape(n, -1), db.reshape(n, -1), None

    return decode
