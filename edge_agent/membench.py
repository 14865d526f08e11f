"""Memory side of the device profile: bandwidth beyond and within the caches, operator cost.

All three run in ONNX Runtime with the agent's own thread settings, on models written as raw
protobuf (:func:`edge_agent.microbench.model_bytes`; the agent does not depend on ``onnx``):

- **memory roof**: a ``ReduceSum`` over a float32 buffer larger than the caches (twice the
  largest cache the OS reports, within 64-256 MiB, see :func:`stream_bytes`), which reads
  every byte once; GB/s is the best of the trials (each the smaller of wall and thread CPU
  time, as the agent times its segments: a core stalled on memory is busy);
- **cache level**: the same read over buffers of 1, 2, 4, ... MiB; the largest one still read
  at least :data:`CACHE_SPEEDUP` times faster than the memory roof is the cache a working set
  must fit in to be read at cache speed (on a VM the OS's cache sizes say little about the
  share a guest really gets: a 2-core guest reporting a 300 MiB L3 reads 16 MiB at DRAM speed);
- **operator cost**: a chain of :data:`OPS` ``Add`` operators on a 64-element vector; the best
  trial's time per operator is the fixed cost every kernel launch pays.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

from edge_agent.config import RuntimeConfig
from edge_agent.microbench import model_bytes, node_bytes

OPS = 256
STREAM_MIN_BYTES = 64 << 20
STREAM_MAX_BYTES = 256 << 20
CACHE_PROBE_BYTES = tuple(1 << (20 + k) for k in range(7))
"""Buffer sizes probed for the cache level: 1 MiB to 64 MiB."""
CACHE_SPEEDUP = 2.0
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


class MemoryProfile(BaseModel):
    """The memory roof, the cache level below it and the per-operator cost."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_gbps: PositiveFloat
    stream_bytes: PositiveInt
    cache_bytes: NonNegativeInt
    cache_gbps: PositiveFloat | None
    op_us: NonNegativeFloat


def reduce_model_bytes(elements: int) -> bytes:
    """A serialized ONNX model: ``y = ReduceSum(x)`` over a float32 vector of ``elements``."""
    node = node_bytes("ReduceSum", ["x"], ["y"], "sum")
    return model_bytes([node], "fedshard_stream", [("x", [elements])], [("y", [1])])


def chain_model_bytes(count: int = OPS, width: int = 64) -> bytes:
    """A serialized ONNX model: ``count`` chained ``h = h + x`` over a float32 vector."""
    nodes = []
    prev = "x"
    for i in range(count):
        out = "y" if i == count - 1 else f"h{i}"
        nodes.append(node_bytes("Add", [prev, "x"], [out], f"add{i}"))
        prev = out
    return model_bytes(nodes, "fedshard_ops", [("x", [width])], [("y", [width])])


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
    """Best streaming-read bandwidth (GB/s) of ``trials`` ReduceSum runs over ``size`` bytes."""
    elements = size // 4
    session = _session(reduce_model_bytes(elements), runtime)
    buffer = np.ones(elements, dtype=np.float32)
    best = _best_run(session, {"x": buffer}, trials, runtime.intra_op_threads)
    return buffer.nbytes / max(best, 1e-9) / 1e9


def measure_op_us(runtime: RuntimeConfig, trials: int = 20) -> float:
    """Best per-operator time (microseconds) of ``trials`` runs of the :data:`OPS`-long chain."""
    session = _session(chain_model_bytes(), runtime)
    best = _best_run(
        session, {"x": np.ones(64, dtype=np.float32)}, trials, runtime.intra_op_threads
    )
    return best / OPS * 1e6


def cache_level(points: list[tuple[int, float]], roof_gbps: float) -> tuple[int, float | None]:
    """``(cache_bytes, cache_gbps)`` from ``(size, GB/s)`` probes in increasing size: the
    largest size up to which every probe reads at least :data:`CACHE_SPEEDUP` x the roof, and
    the median of those probes; ``(0, None)`` if even the smallest does not."""
    inside: list[float] = []
    size = 0
    for probe, gbps in points:
        if gbps < CACHE_SPEEDUP * roof_gbps:
            break
        size = probe
        inside.append(gbps)
    return size, (float(statistics.median(inside)) if inside else None)


def measure_memory(runtime: RuntimeConfig) -> MemoryProfile:
    """The memory roof, the cache level and the operator cost (about a second)."""
    size = stream_bytes()
    roof = measure_memory_gbps(runtime, size, trials=6)
    points = [(p, measure_memory_gbps(runtime, p, trials=4)) for p in CACHE_PROBE_BYTES]
    cache_bytes, cache_gbps = cache_level(points, roof)
    return MemoryProfile(
        memory_gbps=round(roof, 3),
        stream_bytes=size,
        cache_bytes=cache_bytes,
        cache_gbps=None if cache_gbps is None else round(cache_gbps, 3),
        op_us=round(measure_op_us(runtime), 3),
    )


def _session(model: bytes, runtime: RuntimeConfig) -> Any:
    import onnxruntime as ort

    from edge_agent.runtime import session_options

    return ort.InferenceSession(model, session_options(runtime), providers=["CPUExecutionProvider"])


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
