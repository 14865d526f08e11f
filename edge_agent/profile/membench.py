"""Memory side of the device profile: bandwidth beyond and within the caches, operator cost.

All three run in ONNX Runtime with the agent's own thread settings, on models written as raw
protobuf (:func:`edge_agent.protobuf.writer.model_bytes`; the agent does not depend on ``onnx``);
the operator, call and selection models and their probe live in
:mod:`edge_agent.runtime.fixed_costs`, since an agent measures them again next to every warm-up:

- **memory roof**: a matrix-vector product (one row times a float32 matrix) over a matrix
  larger than the caches (twice the largest cache the OS reports, within 64-256 MiB, see
  :func:`stream_bytes`), which reads every byte once, as a decode step reads its weights;
  GB/s is the best of the trials (each the smaller of wall and thread CPU time, as the agent
  times its segments: a core stalled on memory is busy). A ``ReduceSum`` over the same bytes
  reads at about 0.7x of it here (11.4 against 16.3 GB/s, one thread), and Gemma 3 270M's
  int8 decode stages read their weights at the product's speed;
- **cache level**: the same read over buffers of 1, 2, 4, ... MiB; the largest one still read
  at least :data:`CACHE_SPEEDUP` times as fast as the memory roof is the cache a working set
  must fit in to be read at cache speed (on a VM the OS's cache sizes say little about the
  share a guest really gets: a 2-core guest reporting a 300 MiB L3 reads 16 MiB at DRAM speed);
- **operator cost**: a chain of :data:`OPS` operators on a 64-wide row, cycling through the
  kinds a decode step is made of (``fixed_costs.OP_MIX``: a 64 x 64 ``MatMul``, element-wise
  arithmetic and activations, a ``Softmax``); the median run's time per operator is the fixed
  cost every kernel launch pays. An ``Add`` chain alone says 0.45 us here, where the operators
  of a real decode step cost 0.7-0.8 us each (tiny-llama's attention units timed alone);
- **call cost**: one ``session.run`` of a single ``Identity``: what running a segment at all
  costs, once per stage;
- **selection cost**: a ``TopK`` (k = 64) over :data:`TOPK_ELEMENTS` floats, per element: a
  branchy scan the compute roof says nothing about (about 3 ns an element here, 40x what its
  element count over the MatMul roof would say), run by every decoder's trailing candidates.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from edge_agent.config import RuntimeConfig
from edge_agent.profile.base import ProfileModel
from edge_agent.protobuf.writer import model_bytes, node_bytes
from edge_agent.runtime.engine import model_session
from edge_agent.runtime.fixed_costs import (
    OPS,
    TOPK_ELEMENTS,
    TOPK_K,
    FixedCostProbe,
    chain_model_bytes,
    identity_model_bytes,
    median_run,
    topk_model_bytes,
)

STREAM_MIN_BYTES = 64 << 20
STREAM_MAX_BYTES = 256 << 20
CACHE_PROBE_BYTES = tuple(1 << (20 + k) for k in range(7))
"""Buffer sizes probed for the cache level: 1 MiB to 64 MiB."""
CACHE_SPEEDUP = 1.5
CACHE_PASSES = 3
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


class MemoryProfile(ProfileModel):
    """The memory roof, the cache level below it and the per-operator cost."""

    memory_gbps: PositiveFloat
    stream_bytes: PositiveInt
    cache_bytes: NonNegativeInt
    cache_gbps: PositiveFloat | None
    op_us: NonNegativeFloat
    call_us: NonNegativeFloat
    topk_ns: NonNegativeFloat


STREAM_ROWS = 1024
"""Rows of the matrix the streaming read multiplies one vector by."""


def stream_model_bytes(rows: int = STREAM_ROWS) -> bytes:
    """A serialized ONNX model: ``y = x @ w``, one ``[1, rows]`` row times a ``[rows, n]``
    float32 matrix (``n`` symbolic): a matrix-vector product reads every byte of ``w`` once,
    as a decode step reads its weights."""
    node = node_bytes("MatMul", ["x", "w"], ["y"], "gemv")
    inputs: list[tuple[str, list[int | str]]] = [("x", [1, rows]), ("w", [rows, "n"])]
    return model_bytes([node], "fedshard_stream", inputs, [("y", [1, "n"])])


def stream_bytes(cache_dir: Path = _CACHE_DIR) -> int:
    """Buffer size for the memory roof: twice the largest CPU cache the OS reports, within
    [:data:`STREAM_MIN_BYTES`, :data:`STREAM_MAX_BYTES`], a multiple of 1 MiB."""
    largest = 0
    for size_file in sorted(cache_dir.glob("index*/size")):
        try:
            largest = max(largest, parse_cache_size(size_file.read_text()))
        except (OSError, ValueError):
            continue
    wanted = max(STREAM_MIN_BYTES, min(STREAM_MAX_BYTES, 2 * largest))
    return (wanted + (1 << 20) - 1) >> 20 << 20


def parse_cache_size(text: str) -> int:
    """``"32K"``, ``"4096K"``, ``"300M"`` or plain bytes, as sysfs writes cache sizes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale


def measure_memory_gbps(runtime: RuntimeConfig, size: int, trials: int = 10) -> float:
    """Best streaming-read bandwidth (GB/s) of ``trials`` matrix-vector products over a
    ``size``-byte matrix (:func:`stream_model_bytes`)."""
    columns = max(1, size // 4 // STREAM_ROWS)
    session = model_session(stream_model_bytes(), runtime)
    matrix = np.full((STREAM_ROWS, columns), 0.5, dtype=np.float32)
    feeds = {"x": np.ones((1, STREAM_ROWS), dtype=np.float32), "w": matrix}
    best = _best_run(session, feeds, trials, runtime.intra_op_threads)
    return matrix.nbytes / max(best, 1e-9) / 1e9


def measure_op_us(runtime: RuntimeConfig, trials: int = 20) -> float:
    """Typical per-operator time (microseconds): the median of ``trials`` runs of the
    :data:`OPS`-long chain, less one call's cost."""
    session = model_session(chain_model_bytes(), runtime)
    feeds = {"x": np.full((1, 1, 64), 0.01, np.float32), "w": np.eye(64, dtype=np.float32)}
    typical = median_run(session, feeds, trials, runtime.intra_op_threads)
    return max(0.0, typical - measure_call_us(runtime) / 1e6) / OPS * 1e6


def measure_call_us(runtime: RuntimeConfig, trials: int = 50) -> float:
    """Typical time (microseconds) of one ``session.run`` of a single ``Identity``."""
    session = model_session(identity_model_bytes(), runtime)
    feeds = {"x": np.ones(64, dtype=np.float32)}
    return median_run(session, feeds, trials, runtime.intra_op_threads) * 1e6


def measure_topk_ns(runtime: RuntimeConfig, trials: int = 10) -> float:
    """Typical ``TopK`` time per element (nanoseconds) over :data:`TOPK_ELEMENTS` floats."""
    session = model_session(topk_model_bytes(), runtime)
    row = np.random.default_rng(0).standard_normal((1, TOPK_ELEMENTS), dtype=np.float32)
    feeds: dict[str, np.ndarray[Any, Any]] = {"x": row, "k": np.array([TOPK_K], np.int64)}
    typical = median_run(session, feeds, trials, runtime.intra_op_threads)
    return max(0.0, typical - measure_call_us(runtime) / 1e6) / TOPK_ELEMENTS * 1e9


def cache_level(points: list[tuple[int, float]], roof_gbps: float) -> tuple[int, float | None]:
    """``(cache_bytes, cache_gbps)`` from ``(size, GB/s)`` probes in increasing size: the
    largest size still read at least :data:`CACHE_SPEEDUP` x the roof, and the median of the
    probes up to it that are; ``(0, None)`` if none is. One slow probe below it is noise on a
    shared machine (this one read 2 MiB at 11.5 GB/s and 1, 4, 8 and 16 MiB at 17-24 in the
    same second), not the edge of the cache: requiring every probe below to pass put the edge
    at 1 MiB or 32 MiB from run to run."""
    fast = [(probe, gbps) for probe, gbps in points if gbps >= CACHE_SPEEDUP * roof_gbps]
    if not fast:
        return 0, None
    return fast[-1][0], float(statistics.median(gbps for _, gbps in fast))


def cache_points(runtime: RuntimeConfig, passes: int = CACHE_PASSES) -> list[tuple[int, float]]:
    """``(size, GB/s)`` for every size of :data:`CACHE_PROBE_BYTES`: the best of ``passes``
    passes over all the sizes, two reads each. A burst of load that slows a few consecutive
    reads then slows one pass, not every probe of a size (probed one size after the other,
    one burst put this machine's cache edge at 2 MiB instead of 16 MiB, and tiny-llama's
    8 MB output head at memory speed: 1.31x its measured time)."""
    best = dict.fromkeys(CACHE_PROBE_BYTES, 0.0)
    for _ in range(passes):
        for probe in CACHE_PROBE_BYTES:
            best[probe] = max(best[probe], measure_memory_gbps(runtime, probe, trials=2))
    return sorted(best.items())


def measure_memory(runtime: RuntimeConfig) -> MemoryProfile:
    """The memory roof, the cache level and the operator, call and selection costs (about a
    second)."""
    size = stream_bytes()
    roof = measure_memory_gbps(runtime, size, trials=6)
    cache_bytes, cache_gbps = cache_level(cache_points(runtime), roof)
    costs = FixedCostProbe(runtime).measure()
    return MemoryProfile(
        memory_gbps=round(roof, 3),
        stream_bytes=size,
        cache_bytes=cache_bytes,
        cache_gbps=None if cache_gbps is None else round(cache_gbps, 3),
        **costs.model_dump(),
    )


def _best_run(
    session: Any, feeds: dict[str, np.ndarray[Any, Any]], trials: int, threads: int
) -> float:
    """Fastest of ``trials`` runs; with one thread each run counts the smaller of wall time and
    the thread's CPU time (as the agent times its segments: time held off by other processes
    is not the device's speed)."""
    session.run(None, feeds)
    best = float("inf")
    for _ in range(trials):
        start, cpu = time.perf_counter(), time.thread_time()
        session.run(None, feeds)
        wall = time.perf_counter() - start
        best = min(best, min(wall, time.thread_time() - cpu) if threads == 1 else wall)
    return best


def run_spread(values: list[float]) -> float:
    """Largest deviation of a measurement from the median of repeated ones, as a fraction
    (0.1: the worst run was 10% off the median), the stability ``fedshard profile`` promises."""
    if not values or min(values) <= 0:
        raise ValueError("need at least one positive measurement")
    middle = float(statistics.median(values))
    return max(abs(v - middle) for v in values) / middle
