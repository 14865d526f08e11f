"""The one-row 4-bit product roof: ``MatMulNBits`` over a single row, as a decode step runs it.

A decode step of an int4 decoder multiplies one row by every weight matrix of its layers. ONNX
Runtime's ``MatMulNBits`` unpacks and scales each 4-bit weight for that one row, so it runs far
below the float32 ``MatMul`` roof of :mod:`edge_agent.profile.microbench` (measured here, one
thread, a 1536 x 8960 weight at ``accuracy_level`` 0: 22.7 GFLOP/s at one row, 26 at four, 121 at
64, against 209 for float32 ``MatMul``; this chain at level 4, what the export writes: 69.5). The
planner prices a decode step's 4-bit products at this roof (``gemv_gflops``).

The model is a chain of :data:`PRODUCTS` ``[1, K] x [K, K]`` products with 4-bit weights in
blocks of :data:`BLOCK` (what ``fedshard export --weights int4`` writes), their weights
together larger than a core's caches; written as raw protobuf like the other micro-benchmarks.
"""

from __future__ import annotations

import numpy as np

from edge_agent.config import RuntimeConfig
from edge_agent.profile.base import best_gflops
from edge_agent.protobuf.writer import (
    field_bytes,
    initializer_bytes,
    int_attribute_bytes,
    model_bytes,
)
from edge_agent.runtime.engine import session_options

K = 2048
PRODUCTS = 8
BLOCK = 32
BITS = 4
ACCURACY_LEVEL = 4
"""int8 activations times 4-bit weights, as ``fedshard export --weights int4`` writes them."""
_UINT8 = 2  # TensorProto.UINT8
_FLOAT = 1
MS_DOMAIN = "com.microsoft"


def gemv_model_bytes(k: int = K, count: int = PRODUCTS, rows: int | str = 1) -> bytes:
    """A serialized model: ``y = x @ W0 @ W1 ...`` with ``count`` 4-bit ``k x k`` weights, on
    ``rows`` rows (a string: any number)."""
    rng = np.random.default_rng(0)
    blocks = k // BLOCK
    nodes, weights = [], []
    previous = "x"
    for i in range(count):
        out = "y" if i == count - 1 else f"h{i}"
        packed = rng.integers(0, 256, size=(k, blocks, BLOCK * BITS // 8), dtype=np.uint8)
        scales = (rng.random(k * blocks, dtype=np.float32) + 0.5) / (8.0 * k**0.5)
        weights += [
            initializer_bytes(f"w{i}", packed, _UINT8),
            initializer_bytes(f"s{i}", scales, _FLOAT),
        ]
        nodes.append(_nbits_node(previous, f"w{i}", f"s{i}", out, k))
        previous = out
    opsets = (("", 17), (MS_DOMAIN, 1))
    return model_bytes(
        nodes, "fedshard_gemv", [("x", [rows, k])], [("y", [rows, k])], None, weights, opsets
    )


def measure_gemv_gflops(runtime: RuntimeConfig, budget_s: float = 0.5, trials: int = 10) -> float:
    """GFLOP/s of the chain at one row with the agent's thread settings (best trial, counting
    the smaller of wall time and CPU time per thread, as the ``MatMul`` roof does)."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        gemv_model_bytes(), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    feeds = {"x": np.random.default_rng(1).standard_normal((1, K), dtype=np.float32)}
    return best_gflops(session, feeds, 2.0 * K * K * PRODUCTS, runtime, budget_s, trials)


def measure_int4_rows_exact(runtime: RuntimeConfig) -> bool:
    """Whether this machine's ``MatMulNBits`` (the export's block size and accuracy level)
    computes a row bit for bit alike alone and in passes of two and five rows: a speculative
    verify pass of an int4 decoder then decodes each token as a one-token step does. ONNX
    Runtime 1.32's AVX-512 kernel does; its AVX2 kernel runs one row through a kernel of its
    own."""
    import onnxruntime as ort

    model = gemv_model_bytes(k=256, count=2, rows="rows")
    session = ort.InferenceSession(
        model, session_options(runtime), providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(2).standard_normal((5, 256), dtype=np.float32)
    alone = session.run(None, {"x": x[:1]})[0][0]
    return all(np.array_equal(alone, session.run(None, {"x": x[:rows]})[0][0]) for rows in (2, 5))


def _nbits_node(x: str, weight: str, scales: str, out: str, k: int) -> bytes:
    attributes = [
        ("K", k), ("N", k), ("bits", BITS), ("block_size", BLOCK),
        ("accuracy_level", ACCURACY_LEVEL),
    ]  # fmt: skip
    return b"".join(
        [
            *(field_bytes(1, name.encode()) for name in (x, weight, scales)),
            field_bytes(2, out.encode()),
            field_bytes(3, f"nbits_{out}".encode()),
            field_bytes(4, b"MatMulNBits"),
            *(field_bytes(5, int_attribute_bytes(name, value)) for name, value in attributes),
            field_bytes(7, MS_DOMAIN.encode()),
        ]
    )
