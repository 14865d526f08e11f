"""The vector roof: element-wise work as a transformer block runs it, per element.

A product does ~100 multiply-adds per byte it reads; the rest of a transformer block (bias adds,
the residual add and layer norm ONNX Runtime fuses into ``SkipLayerNormalization``, GELU, the
softmax, transposes) does one or two per element and runs about 100x slower per counted FLOP:
on MiniLM at 1 x 256 those operators took 39 % of the time while the ``MatMul`` roof priced them
at 0.6 % (timed here with ONNX Runtime's profiler, one thread). Priced at the ``MatMul`` roof,
encoder stages were predicted at 0.59-0.69x of their time.

The model is :data:`BLOCKS` repetitions of that element-wise pattern on a ``[1, ROWS, WIDTH]``
hidden state (opset 20, written as raw protobuf like the other micro-benchmarks: the agent does
not depend on ``onnx``). Its elements are counted as the planner counts them
(:func:`partitioner.analysis.costs.node_flops`: one per element of a node's largest input or
output), so ``vector_gflops`` is what one such counted element costs: the planner prices every
operator that is not a product, a gather, a view or a ``TopK`` at it.
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
    varint_field_bytes,
)
from edge_agent.runtime.engine import session_options

ROWS = 128
WIDTH = 384
BLOCKS = 4
_INTS_ATTRIBUTE = 7  # AttributeProto.INTS
_PATTERN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Add", ("{prev}", "bias")),
    ("Add", ("{0}", "x")),
    ("LayerNormalization", ("{1}", "gamma", "bias")),
    ("Add", ("{2}", "bias")),
    ("Gelu", ("{3}",)),
    ("Mul", ("{4}", "x")),
    ("Softmax", ("{5}",)),
    ("Transpose", ("{6}",)),
    ("Sigmoid", ("{7}",)),
    ("Transpose", ("{8}",)),
)
"""One block: ``{prev}`` is the block's input, ``{i}`` the output of the block's i-th node.
Bias, residual add and layer norm fuse into ``SkipLayerNormalization`` and bias with GELU into
``BiasGelu``, as in an exported encoder; the transposes (each swaps the last two axes, as
attention's do) do not cancel: a sigmoid stands between them."""


def vector_model_bytes(rows: int = ROWS, width: int = WIDTH, blocks: int = BLOCKS) -> bytes:
    """A serialized opset-20 model: ``blocks`` repetitions of :data:`_PATTERN`."""
    nodes = []
    previous = "x"
    for b in range(blocks):
        names = [f"b{b}n{i}" for i in range(len(_PATTERN))]
        if b == blocks - 1:
            names[-1] = "y"
        for i, (op, inputs) in enumerate(_PATTERN):
            resolved = [name.format(*names, prev=previous) for name in inputs]
            nodes.append(_node(op, resolved, names[i]))
        previous = names[-1]
    rng = np.random.default_rng(0)
    bias = (rng.random(width, dtype=np.float32) - 0.5) * 0.1
    initializers = [
        initializer_bytes("bias", bias),
        initializer_bytes("gamma", np.ones(width, np.float32)),
    ]
    shape = [1, rows, width]
    return model_bytes(
        nodes, "fedshard_vector", [("x", shape)], [("y", shape)], None, initializers, (("", 20),)
    )


def counted_elements(rows: int = ROWS, width: int = WIDTH, blocks: int = BLOCKS) -> int:
    """The elements the planner counts for :func:`vector_model_bytes`: every node reads or
    writes one ``rows x width`` tensor at most."""
    return blocks * len(_PATTERN) * rows * width


def measure_vector_gflops(runtime: RuntimeConfig, budget_s: float = 0.5, trials: int = 10) -> float:
    """Counted elements per nanosecond (as GFLOP/s) of the block chain with the agent's thread
    settings (best trial, each the smaller of wall and thread CPU time, as the other roofs)."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        vector_model_bytes(), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    feeds = {"x": np.random.default_rng(1).standard_normal((1, ROWS, WIDTH), dtype=np.float32)}
    return best_gflops(session, feeds, float(counted_elements()), runtime, budget_s, trials)


def _node(op: str, inputs: list[str], output: str) -> bytes:
    attributes: list[bytes] = []
    if op in ("LayerNormalization", "Softmax"):
        attributes = [int_attribute_bytes("axis", -1)]
    elif op == "Transpose":
        attributes = [_perm_attribute((0, 2, 1))]
    return b"".join(
        [
            *(field_bytes(1, name.encode()) for name in inputs),
            field_bytes(2, output.encode()),
            field_bytes(3, f"{op.lower()}_{output}".encode()),
            field_bytes(4, op.encode()),
            *(field_bytes(5, attribute) for attribute in attributes),
        ]
    )


def _perm_attribute(perm: tuple[int, ...]) -> bytes:
    """A ``perm`` attribute of type INTS."""
    values = b"".join(varint_field_bytes(8, p) for p in perm)
    return field_bytes(1, b"perm") + values + varint_field_bytes(20, _INTS_ATTRIBUTE)
