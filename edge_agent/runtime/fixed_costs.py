"""The fixed costs a run pays beyond its roofs: one operator, one call, a ``TopK`` element.

An agent measures them next to every warm-up (:class:`FixedCostProbe`, a few milliseconds) and
announces the median of its latest measurements (:class:`RecentCosts`); the start-up profile
measures them with the same models (:mod:`edge_agent.profile.membench`, whose docstring says
why each is measured as it is). The models are written as raw protobuf
(:mod:`edge_agent.protobuf.writer`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from edge_agent.config import RuntimeConfig
from edge_agent.protobuf.writer import model_bytes, node_bytes
from edge_agent.runtime.engine import model_session
from protocols.deploy import FixedCosts

OPS = 256
OP_MIX = ("MatMul", "Add", "Softmax", "Mul", "Sigmoid", "Neg", "Sqrt", "Abs")
"""The operator kinds the operator-cost chain cycles through."""
TOPK_ELEMENTS = 1 << 15
TOPK_K = 64
_INT64 = 7  # TensorProto.INT64


def chain_model_bytes(count: int = OPS, width: int = 64) -> bytes:
    """A serialized ONNX model: ``count`` chained operators over a ``[1, rows, width]`` hidden
    state (``rows`` symbolic, as a decoder's sequence is; run on one row), the
    kinds of :data:`OP_MIX` in turn (``MatMul`` by the ``[width, width]`` input ``w``; binary
    ones with the input ``x``)."""
    nodes = []
    prev = "x"
    for i in range(count):
        op = OP_MIX[i % len(OP_MIX)]
        out = "y" if i == count - 1 else f"h{i}"
        inputs = {"MatMul": [prev, "w"], "Add": [prev, "x"], "Mul": [prev, "x"]}.get(op, [prev])
        nodes.append(node_bytes(op, inputs, [out], f"op{i}"))
        prev = out
    shapes: list[tuple[str, list[int | str]]] = [("x", [1, "rows", width]), ("w", [width, width])]
    return model_bytes(nodes, "fedshard_ops", shapes, [("y", [1, "rows", width])])


def identity_model_bytes(width: int = 64) -> bytes:
    """A serialized ONNX model: ``y = Identity(x)``, the cheapest segment there is."""
    node = node_bytes("Identity", ["x"], ["y"], "id")
    return model_bytes([node], "fedshard_call", [("x", [width])], [("y", [width])])


def topk_model_bytes(elements: int = TOPK_ELEMENTS, k: int = TOPK_K) -> bytes:
    """A serialized ONNX model: the ``k`` largest of a ``[1, elements]`` row (``TopK`` with
    ``k`` as an int64 input)."""
    node = node_bytes("TopK", ["x", "k"], ["v", "i"], "topk")
    kinds = {"k": _INT64, "i": _INT64}
    return model_bytes(
        [node],
        "fedshard_topk",
        [("x", [1, elements]), ("k", [1])],
        [("v", [1, k]), ("i", [1, k])],
        kinds,
    )


class FixedCostProbe:
    """The operator, call and selection benchmarks, their sessions built once: an agent
    measures them again next to every warm-up (:meth:`measure`, a few milliseconds), since
    they move with the load by up to 2.5x in a few minutes."""

    def __init__(self, runtime: RuntimeConfig) -> None:
        self._threads = runtime.intra_op_threads
        self._chain = model_session(chain_model_bytes(), runtime)
        self._call = model_session(identity_model_bytes(), runtime)
        self._topk = model_session(topk_model_bytes(), runtime)
        row = np.random.default_rng(0).standard_normal((1, TOPK_ELEMENTS), dtype=np.float32)
        self._feeds: tuple[dict[str, np.ndarray[Any, Any]], ...] = (
            {"x": np.full((1, 1, 64), 0.01, np.float32), "w": np.eye(64, dtype=np.float32)},
            {"x": np.ones(64, dtype=np.float32)},
            {"x": row, "k": np.array([TOPK_K], np.int64)},
        )

    def measure(self, trials: int = 20) -> FixedCosts:
        """``op_us``, ``call_us`` and ``topk_ns`` as the start-up profile's
        :func:`edge_agent.profile.membench.measure_op_us`, ``measure_call_us`` and
        ``measure_topk_ns`` measure them."""
        chain, call, topk = self._feeds
        call_s = median_run(self._call, call, 2 * trials, self._threads)
        op_s = median_run(self._chain, chain, trials, self._threads) - call_s
        topk_s = median_run(self._topk, topk, trials // 2, self._threads) - call_s
        return FixedCosts(
            op_us=round(max(0.0, op_s) / OPS * 1e6, 3),
            call_us=round(call_s * 1e6, 3),
            topk_ns=round(max(0.0, topk_s) / TOPK_ELEMENTS * 1e9, 3),
        )


def mean_costs(first: FixedCosts, second: FixedCosts) -> FixedCosts:
    """The average of two measurements (before a segment's load and after its warm-up)."""
    return FixedCosts(
        op_us=round((first.op_us + second.op_us) / 2, 3),
        call_us=round((first.call_us + second.call_us) / 2, 3),
        topk_ns=round((first.topk_ns + second.topk_ns) / 2, 3),
    )


COSTS_WINDOW = 5
"""How many of its latest cost measurements an agent announces the median of."""


class RecentCosts:
    """An agent's latest fixed-cost measurements (one per warm-up), announced as their
    element-wise median (:meth:`add` returns it).

    The next plan is priced with what the agent announces, before the deploy it prices is
    measured. One warm-up's costs can run 1.8x the ones before and after it (tiny-llama's
    0.14 ms stage, 2026-12-05: the fixed part measured 0.20 ms once between 0.11 ms ones, and
    the stage with it), which priced the stage after it at 1.86x; the median of the latest
    :data:`COSTS_WINDOW` leaves such a minute out and still follows a device that stays slower.
    The start-up profile's costs are not among them: they may be a cached profile's, measured
    in another hour (with them, tiny-gemma3's first calibrated deploys were priced at 1.5-1.7x).
    """

    def __init__(self) -> None:
        self._latest: list[FixedCosts] = []

    def add(self, costs: FixedCosts) -> FixedCosts:
        """Keep ``costs`` as the newest measurement; returns the element-wise median of the
        kept ones."""
        self._latest = [*self._latest, costs][-COSTS_WINDOW:]
        return FixedCosts(
            op_us=statistics.median(c.op_us for c in self._latest),
            call_us=statistics.median(c.call_us for c in self._latest),
            topk_ns=statistics.median(c.topk_ns for c in self._latest),
        )


def median_run(
    session: Any, feeds: dict[str, np.ndarray[Any, Any]], trials: int, threads: int
) -> float:
    """Median of ``trials`` runs, each timed as the profile's benchmarks time them (with one thread,
    the smaller of wall and thread CPU time): the fixed costs are measured the way the agent
    measures its stages (the median of its warm-up runs), so both move together when the cores are
    shared (the best run of a 1 us kernel is the one that found the caches warm, which a real stage
    seldom does)."""
    session.run(None, feeds)
    times = []
    for _ in range(trials):
        start, cpu = time.perf_counter(), time.thread_time()
        session.run(None, feeds)
        wall = time.perf_counter() - start
        times.append(min(wall, time.thread_time() - cpu) if threads == 1 else wall)
    return float(statistics.median(times))
