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
  :mod:`edge_agent.profile.membench` (a matrix-vector product over a matrix larger than the caches;
  the fixed costs of a kernel launch, of a segment run and of a ``TopK`` element, which
  dominate small segments).
- **One-row 4-bit products** (a decode step of an int4 decoder): see
  :mod:`edge_agent.profile.gemvbench`.
- **Element-wise operators** (a transformer block's adds, norms, activations, softmax and
  transposes): see :mod:`edge_agent.profile.vectorbench`.
"""

from __future__ import annotations

import datetime as dt
import logging
import platform
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
)

from edge_agent.config import RuntimeConfig
from edge_agent.profile.base import ProfileModel, best_gflops
from edge_agent.profile.gemvbench import (
    ACCURACY_LEVEL,
    measure_gemv_gflops,
    measure_int4_rows_exact,
)
from edge_agent.profile.membench import measure_memory
from edge_agent.profile.vectorbench import measure_vector_gflops
from edge_agent.protobuf.writer import matmul_model_bytes
from edge_agent.runtime.engine import session_options
from hostkit.files import write_atomic
from protocols.roofs import ROOF_FIELD_NAMES

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
MATRIX = 256
MATMULS = 4


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
    """GFLOP/s of a one-row 4-bit weight product (:mod:`edge_agent.profile.gemvbench`)."""
    gemv_accuracy_level: NonNegativeInt | None = None
    """The ``MatMulNBits`` kernel it was measured with (a cache measured with another one is
    measured again)."""
    vector_gflops: PositiveFloat | None = None
    """Counted elements per nanosecond of a transformer block's element-wise operators
    (:mod:`edge_agent.profile.vectorbench`); None in caches written before it (measured again)."""
    int4_rows_exact: bool | None = None
    """Whether a 4-bit product computes a row alike alone and in a pass
    (:func:`edge_agent.profile.gemvbench.measure_int4_rows_exact`); None in caches written before it
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


def measure_profile(runtime: RuntimeConfig) -> ComputeProfile:
    """Both roofs, the cache level and the operator cost with the agent's thread settings
    (about two seconds)."""
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

    session = ort.InferenceSession(
        matmul_model_bytes(MATRIX, MATMULS),
        session_options(runtime),
        providers=["CPUExecutionProvider"],
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
