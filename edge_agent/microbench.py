"""Device profile: the two roofs (compute and memory bandwidth), cached in the state dir.

Both micro-benchmarks run in ONNX Runtime with the agent's own thread settings, since that is
what will run the segments. The models are written as raw protobuf (the agent does not depend
on the ``onnx`` package).

- **Compute**: ``MATMULS`` chained ``[N, N] x [N, N]`` products, so one run is large enough that
  the per-call overhead does not matter. Each trial counts the smaller of wall time and process
  CPU time per thread (ORT spinning is off, so CPU time is busy time), and GFLOP/s is the best
  trial (as ``timeit`` advises): that keeps it within about 10% on a machine shared with other
  work.
- **Memory bandwidth**: a ``ReduceSum`` over a float32 buffer larger than the caches (twice the
  largest cache the OS reports, see :func:`stream_bytes`), which reads every byte once; GB/s is
  the best of the trials (wall time: a streaming read waits on memory, not on the core).
"""

from __future__ import annotations

import datetime as dt
import logging
import platform
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, ValidationError

from edge_agent.config import RuntimeConfig

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
MATRIX = 256
MATMULS = 4
STREAM_MIN_BYTES = 64 << 20
STREAM_MAX_BYTES = 512 << 20
_FLOAT = 1  # TensorProto.FLOAT
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


class ComputeProfile(BaseModel):
    """What ``fedshard profile`` measures and caches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gflops: PositiveFloat
    memory_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth in GB/s (10^9 bytes/s); None in caches written before it was
    measured (such a cache is measured again)."""
    stream_bytes: PositiveInt | None = None
    """Size of the buffer the bandwidth was measured on."""
    intra_op_threads: PositiveInt
    inter_op_threads: PositiveInt
    onnxruntime_version: str
    machine: str
    matrix: PositiveInt
    trials: PositiveInt
    measured_at: str


def matmul_model_bytes(n: int = MATRIX, count: int = MATMULS) -> bytes:
    """A serialized ONNX model: ``y = ((x @ w) @ w) ...`` with ``count`` MatMuls of ``n x n``."""
    shape = [n, n]
    nodes = []
    prev = "x"
    for i in range(count):
        out = "y" if i == count - 1 else f"h{i}"
        nodes.append(_node("MatMul", [prev, "w"], [out], f"mm{i}"))
        prev = out
    graph = b"".join(
        [
            *(_field(1, node) for node in nodes),
            _field(2, b"fedshard_microbench"),
            _field(11, _value_info("x", shape)),
            _field(11, _value_info("w", shape)),
            _field(12, _value_info("y", shape)),
        ]
    )
    opset = _field(1, b"") + _varint_field(2, 17)
    return _varint_field(1, 8) + _field(2, b"fedshard") + _field(7, graph) + _field(8, opset)


def reduce_model_bytes(elements: int) -> bytes:
    """A serialized ONNX model: ``y = ReduceSum(x)`` over a float32 vector of ``elements``."""
    node = _node("ReduceSum", ["x"], ["y"], "sum")
    graph = b"".join(
        [
            _field(1, node),
            _field(2, b"fedshard_stream"),
            _field(11, _value_info("x", [elements])),
            _field(12, _value_info("y", [1])),
        ]
    )
    opset = _field(1, b"") + _varint_field(2, 17)
    return _varint_field(1, 8) + _field(2, b"fedshard") + _field(7, graph) + _field(8, opset)


def stream_bytes(cache_dir: Path = _CACHE_DIR) -> int:
    """Buffer size for the bandwidth benchmark: twice the largest CPU cache the OS reports,
    within [:data:`STREAM_MIN_BYTES`, :data:`STREAM_MAX_BYTES`], a multiple of 1 MiB."""
    largest = 0
    for size_file in sorted(cache_dir.glob("index*/size")):
        try:
            largest = max(largest, _parse_cache_size(size_file.read_text()))
        except (OSError, ValueError):
            continue
    wanted = max(STREAM_MIN_BYTES, min(STREAM_MAX_BYTES, 2 * largest))
    return (wanted + (1 << 20) - 1) >> 20 << 20


def _parse_cache_size(text: str) -> int:
    """``"32K"``, ``"4096K"``, ``"300M"`` or plain bytes, as sysfs writes cache sizes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale


def measure_memory_gbps(runtime: RuntimeConfig, size: int | None = None, trials: int = 10) -> float:
    """Best streaming-read bandwidth (GB/s) of ``trials`` ReduceSum runs over ``size`` bytes."""
    import onnxruntime as ort

    from edge_agent.runtime import session_options

    elements = (size or stream_bytes()) // 4
    session = ort.InferenceSession(
        reduce_model_bytes(elements), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    buffer = np.ones(elements, dtype=np.float32)
    feeds = {"x": buffer}
    session.run(None, feeds)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / max(best, 1e-9) / 1e9


def measure_profile(runtime: RuntimeConfig) -> ComputeProfile:
    """Both roofs with the agent's thread settings (about two seconds)."""
    compute = measure_gflops(runtime)
    size = stream_bytes()
    gbps = measure_memory_gbps(runtime, size)
    return compute.model_copy(update={"memory_gbps": round(gbps, 3), "stream_bytes": size})


def measure_gflops(
    runtime: RuntimeConfig, budget_s: float = 1.0, trials: int = 10
) -> ComputeProfile:
    """Run the MatMul micro-benchmark with the agent's thread settings; about ``budget_s``
    seconds (the profile it returns has no bandwidth; see :func:`measure_profile`)."""
    import onnxruntime as ort

    from edge_agent.runtime import session_options

    session = ort.InferenceSession(
        matmul_model_bytes(), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((MATRIX, MATRIX), dtype=np.float32),
        "w": (rng.standard_normal((MATRIX, MATRIX), dtype=np.float32) / MATRIX**0.5),
    }
    flops = 2.0 * MATRIX**3 * MATMULS
    session.run(None, feeds)
    start = time.perf_counter()
    session.run(None, feeds)
    one = max(time.perf_counter() - start, 1e-6)
    runs = max(1, int(budget_s / trials / one))
    best = 0.0
    threads = runtime.intra_op_threads
    for _ in range(trials):
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(runs):
            session.run(None, feeds)
        wall = time.perf_counter() - start
        # CPU time per thread is what the runs cost when the cores are not shared with other
        # processes; wall time is the bound when they are not saturated.
        busy = min(wall, max((time.process_time() - cpu_start) / threads, 1e-9))
        best = max(best, flops * runs / busy / 1e9)
    return ComputeProfile(
        gflops=round(best, 3),
        intra_op_threads=runtime.intra_op_threads,
        inter_op_threads=runtime.inter_op_threads,
        onnxruntime_version=ort.__version__,
        machine=platform.machine(),
        matrix=MATRIX,
        trials=trials,
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )


def load_or_measure(
    state_dir: Path, runtime: RuntimeConfig, remeasure: bool = False
) -> ComputeProfile:
    """The cached profile when it was measured with the same settings, else a fresh measurement."""
    import onnxruntime as ort

    path = state_dir / PROFILE_FILE
    if not remeasure and path.exists():
        try:
            cached = ComputeProfile.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            log.warning("ignoring unreadable profile cache %s: %s", path, exc)
        else:
            if (
                cached.memory_gbps is not None
                and cached.intra_op_threads == runtime.intra_op_threads
                and cached.inter_op_threads == runtime.inter_op_threads
                and cached.onnxruntime_version == ort.__version__
            ):
                return cached
    profile = measure_profile(runtime)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(profile.model_dump_json(indent=2))
    tmp.replace(path)
    log.info(
        "measured %.1f GFLOP/s and %.1f GB/s with %d thread(s)",
        profile.gflops,
        profile.memory_gbps,
        runtime.intra_op_threads,
    )
    return profile


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _node(op: str, inputs: list[str], outputs: list[str], name: str) -> bytes:
    return b"".join(
        [
            *(_field(1, i.encode()) for i in inputs),
            *(_field(2, o.encode()) for o in outputs),
            _field(3, name.encode()),
            _field(4, op.encode()),
        ]
    )


def _value_info(name: str, shape: list[int]) -> bytes:
    dims = b"".join(_field(1, _varint_field(1, d)) for d in shape)
    tensor_type = _varint_field(1, _FLOAT) + _field(2, dims)
    return _field(1, name.encode()) + _field(2, _field(1, tensor_type))
