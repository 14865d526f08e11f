"""Device profile: the roofs (compute, memory, 4-bit products, element-wise), cached in state.

Both micro-benchmarks run in ONNX Runtime with the agent's own thread settings, since that is
what will run the segments. The models are written as raw protobuf (the agent does not depend
on the ``onnx`` package).

- **Compute**: ``MATMULS`` chained ``[N, N] x [N, N]`` products, so one run is large enough that
  the per-call overhead does not matter. Each trial counts the smaller of wall time and process
  CPU time per thread (ORT spinning is off, so CPU time is busy time), and GFLOP/s is the best
  trial (as ``timeit`` advises): that keeps it within about 10% on a machine shared with other
  work.
- **Memory bandwidth, the cache level, operator, call and selection costs**: see
  :mod:`edge_agent.membench` (a matrix-vector product over a matrix larger than the caches;
  the fixed costs of a kernel launch, of a segment run and of a ``TopK`` element, which
  dominate small segments).
- **One-row 4-bit products** (a decode step of an int4 decoder): see
  :mod:`edge_agent.gemvbench`.
- **Element-wise operators** (a transformer block's adds, norms, activations, softmax and
  transposes): see :mod:`edge_agent.vectorbench`.
"""

from __future__ import annotations

import datetime as dt
import logging
import platform
import time
from collections.abc import Sequence
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
    ValidationError,
)

from edge_agent.config import RuntimeConfig
from hostkit.files import write_atomic
from protocols.roofs import ROOF_FIELD_NAMES

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
MATRIX = 256
MATMULS = 4
_FLOAT = 1  # TensorProto.FLOAT


class ProfileModel(BaseModel):
    """The base of the profile's models: frozen, unknown fields refused (a cache written by
    another version is measured again)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ComputeProfile(ProfileModel):
    """What ``fedshard profile`` measures and caches."""

    gflops: PositiveFloat
    memory_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth in GB/s (10^9 bytes/s) beyond the caches; None in caches
    written before it was measured (such a cache is measured again)."""
    stream_bytes: PositiveInt | None = None
    """Size of the buffer the bandwidth was measured on."""
    cache_bytes: NonNegativeInt | None = None
    """Largest buffer still read at least twice as fast as memory (0: no such cache)."""
    cache_gbps: PositiveFloat | None = None
    """Streaming-read bandwidth of a buffer of ``cache_bytes``."""
    op_us: NonNegativeFloat | None = None
    """Fixed cost of one operator, microseconds."""
    call_us: NonNegativeFloat | None = None
    """Fixed cost of one segment run (``session.run`` of one input and output), microseconds."""
    topk_ns: NonNegativeFloat | None = None
    """Cost of a ``TopK`` per element it selects from, nanoseconds."""
    gemv_gflops: PositiveFloat | None = None
    """GFLOP/s of a one-row 4-bit weight product (:mod:`edge_agent.gemvbench`)."""
    gemv_accuracy_level: NonNegativeInt | None = None
    """The ``MatMulNBits`` kernel it was measured with (a cache measured with another one is
    measured again)."""
    vector_gflops: PositiveFloat | None = None
    """Counted elements per nanosecond of a transformer block's element-wise operators
    (:mod:`edge_agent.vectorbench`); None in caches written before it (measured again)."""
    int4_rows_exact: bool | None = None
    """Whether a 4-bit product computes a row alike alone and in a pass
    (:func:`edge_agent.gemvbench.measure_int4_rows_exact`); None in caches written before it
    (measured again)."""
    intra_op_threads: PositiveInt
    inter_op_threads: PositiveInt
    onnxruntime_version: str
    machine: str
    matrix: PositiveInt
    trials: PositiveInt
    measured_at: str

    def roofs(self) -> dict[str, Any]:
        """The fields every announcement and status carries (:data:`ROOF_FIELDS`), by name."""
        return self.model_dump(include=set(ROOF_FIELDS))


ROOF_FIELDS = ("gflops", *ROOF_FIELD_NAMES)
"""The measured roofs, as ``DeviceProfile`` and ``AgentStatus`` name them too."""


def matmul_model_bytes(n: int = MATRIX, count: int = MATMULS) -> bytes:
    """A serialized ONNX model: ``y = ((x @ w) @ w) ...`` with ``count`` MatMuls of ``n x n``."""
    shape = [n, n]
    nodes = []
    prev = "x"
    for i in range(count):
        out = "y" if i == count - 1 else f"h{i}"
        nodes.append(node_bytes("MatMul", [prev, "w"], [out], f"mm{i}"))
        prev = out
    return model_bytes(nodes, "fedshard_microbench", [("x", shape), ("w", shape)], [("y", shape)])


def model_bytes(
    nodes: list[bytes],
    name: str,
    inputs: Sequence[tuple[str, Sequence[int | str]]],
    outputs: Sequence[tuple[str, Sequence[int | str]]],
    types: dict[str, int] | None = None,
    initializers: Sequence[bytes] = (),
    opsets: Sequence[tuple[str, int]] = (("", 17),),
) -> bytes:
    """A serialized ONNX model of ``nodes`` (from :func:`node_bytes`) with ``initializers``
    (from :func:`initializer_bytes`), ``inputs`` and ``outputs`` of the given shapes (a string
    is a symbolic dimension), float32 unless ``types`` gives a ``TensorProto`` element type by
    name, importing ``opsets`` (domain, version; the default opset 17)."""
    kinds = types or {}
    graph = b"".join(
        [
            *(field_bytes(1, node) for node in nodes),
            field_bytes(2, name.encode()),
            *(field_bytes(5, tensor) for tensor in initializers),
            *(
                field_bytes(11, value_info_bytes(n, shape, kinds.get(n, _FLOAT)))
                for n, shape in inputs
            ),
            *(
                field_bytes(12, value_info_bytes(n, shape, kinds.get(n, _FLOAT)))
                for n, shape in outputs
            ),
        ]
    )
    imports = b"".join(
        field_bytes(8, field_bytes(1, domain.encode()) + varint_field_bytes(2, version))
        for domain, version in opsets
    )
    return varint_field_bytes(1, 8) + field_bytes(2, b"fedshard") + field_bytes(7, graph) + imports


def measure_profile(runtime: RuntimeConfig) -> ComputeProfile:
    """Both roofs, the cache level and the operator cost with the agent's thread settings
    (about two seconds)."""
    from edge_agent.gemvbench import ACCURACY_LEVEL, measure_gemv_gflops, measure_int4_rows_exact
    from edge_agent.membench import measure_memory
    from edge_agent.vectorbench import measure_vector_gflops

    compute = measure_gflops(runtime)
    memory = measure_memory(runtime)
    gemv = measure_gemv_gflops(runtime)
    vector = measure_vector_gflops(runtime)
    return compute.model_copy(
        update={
            **memory.model_dump(),
            "gemv_gflops": gemv,
            "gemv_accuracy_level": ACCURACY_LEVEL,
            "vector_gflops": vector,
            "int4_rows_exact": measure_int4_rows_exact(runtime),
        }
    )


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
    best = best_gflops(session, feeds, 2.0 * MATRIX**3 * MATMULS, runtime, budget_s, trials)
    return ComputeProfile(
        gflops=best,
        intra_op_threads=runtime.intra_op_threads,
        inter_op_threads=runtime.inter_op_threads,
        onnxruntime_version=ort.__version__,
        machine=platform.machine(),
        matrix=MATRIX,
        trials=trials,
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )


def best_gflops(
    session: Any,
    feeds: dict[str, np.ndarray],
    flops: float,
    runtime: RuntimeConfig,
    budget_s: float,
    trials: int,
) -> float:
    """GFLOP/s of ``session`` on ``feeds`` (``flops`` a run): the best of ``trials`` trials
    of about ``budget_s / trials`` seconds each, rounded to 3 decimals."""
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
    return round(best, 3)


def load_or_measure(
    state_dir: Path, runtime: RuntimeConfig, remeasure: bool = False
) -> ComputeProfile:
    """The cached profile when it was measured with the same settings, else a fresh measurement."""
    import onnxruntime as ort

    from edge_agent.gemvbench import ACCURACY_LEVEL

    path = state_dir / PROFILE_FILE
    if not remeasure and path.exists():
        try:
            cached = ComputeProfile.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            log.warning("ignoring unreadable profile cache %s: %s", path, exc)
        else:
            if (
                cached.memory_gbps is not None
                and cached.op_us is not None
                and cached.call_us is not None
                and cached.topk_ns is not None
                and cached.gemv_gflops is not None
                and cached.vector_gflops is not None
                and cached.int4_rows_exact is not None
                and cached.gemv_accuracy_level == ACCURACY_LEVEL
                and cached.intra_op_threads == runtime.intra_op_threads
                and cached.inter_op_threads == runtime.inter_op_threads
                and cached.onnxruntime_version == ort.__version__
            ):
                return cached
    profile = measure_profile(runtime)
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, profile.model_dump_json(indent=2).encode())
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


def varint_field_bytes(number: int, value: int) -> bytes:
    """A protobuf varint field."""
    return _varint(number << 3) + _varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    """A protobuf length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def int_attribute_bytes(name: str, value: int) -> bytes:
    """A serialized ``AttributeProto`` of type INT (negative values as protobuf's int64)."""
    encoded = value & 0xFFFFFFFFFFFFFFFF
    kind = varint_field_bytes(20, 2)  # AttributeProto.INT
    return field_bytes(1, name.encode()) + varint_field_bytes(3, encoded) + kind


def initializer_bytes(name: str, array: np.ndarray, data_type: int = _FLOAT) -> bytes:
    """A serialized ``TensorProto`` initializer: ``array``'s raw little-endian bytes."""
    dims = b"".join(varint_field_bytes(1, d) for d in array.shape)
    return (
        dims
        + varint_field_bytes(2, data_type)
        + field_bytes(8, name.encode())
        + field_bytes(9, np.ascontiguousarray(array).tobytes())
    )


def node_bytes(op: str, inputs: list[str], outputs: list[str], name: str) -> bytes:
    """A serialized ``NodeProto`` without attributes."""
    return b"".join(
        [
            *(field_bytes(1, i.encode()) for i in inputs),
            *(field_bytes(2, o.encode()) for o in outputs),
            field_bytes(3, name.encode()),
            field_bytes(4, op.encode()),
        ]
    )


def value_info_bytes(name: str, shape: Sequence[int | str], elem_type: int = _FLOAT) -> bytes:
    """A serialized ``ValueInfoProto``: a tensor's name, element type and shape."""
    dims = b"".join(
        field_bytes(
            1, field_bytes(2, d.encode()) if isinstance(d, str) else varint_field_bytes(1, d)
        )
        for d in shape
    )
    tensor_type = varint_field_bytes(1, elem_type) + field_bytes(2, dims)
    return field_bytes(1, name.encode()) + field_bytes(2, field_bytes(1, tensor_type))
