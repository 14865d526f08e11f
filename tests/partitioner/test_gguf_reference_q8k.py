"""The numpy reference's Q8_K activation rounding (llama.cpp's ``quantize_row_q8_K_ref``)."""

from __future__ import annotations

import numpy as np
import pytest

from partitioner.models.gguf.reference import Q8_K_BLOCK, q8_k


def test_q8_k_rounds_each_block_to_its_largest_magnitude_over_minus_128() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2 * Q8_K_BLOCK))
    x[0, 5], x[0, 6] = 7.5, -7.5  # the block's largest magnitude: 7.5 -> code -128, -7.5 -> 127
    y = q8_k(x)
    for row, yrow in zip(x.reshape(-1, Q8_K_BLOCK), y.reshape(-1, Q8_K_BLOCK), strict=True):
        big = row[np.abs(row).argmax()]
        d = np.float32(1.0) / np.float32(np.float32(-128.0) / np.float32(big))
        codes = yrow / d
        np.testing.assert_allclose(codes, np.rint(codes), atol=1e-3)
        assert codes.max() <= 127 and codes.min() >= -128
        assert np.abs(row - yrow).max() <= abs(d) + 1e-5  # a step at most (the clamp)
    assert y.shape == x.shape
    assert y[0, 5] == pytest.approx(7.5) and y[0, 6] == pytest.approx(-7.5 * 127 / 128)


def test_q8_k_loses_a_blocks_small_values_next_to_an_outlier() -> None:
    x = np.full((1, Q8_K_BLOCK), 0.25)
    x[0, 0] = 3000.0
    y = q8_k(x)
    assert y[0, 0] == pytest.approx(3000.0, rel=1e-2)
    assert np.all(y[0, 1:] == 0.0)  # 0.25 is under half a step (3000 / 128)
    calm = np.full((1, Q8_K_BLOCK), 0.25)
    np.testing.assert_allclose(q8_k(calm), calm, rtol=1e-2)
