"""ONNX Runtime: session options, loading a segment with its memory measured, warm-up, runs.

What a loaded segment really costs in resident memory, and the choices made here
(all-MiniLM-L6-v2 cut in three, batch 1 x 128 tokens, one intra-op thread, ORT 1.32, glibc;
"resident" is RSS after load and warm-up minus RSS before, each measured in a fresh process):

- **Freed heap kept by glibc.** ORT parses the segment, copies every initializer out of the
  protobuf and frees the protobuf; pre-packing then replaces MatMul weights with packed copies
  and frees the originals. glibc keeps that freed memory in the process (segment 0: 72 MB
  resident right after load for 62 MB of weights, segments 1-2: 27 MB for 14 MB).
  :func:`release_freed_heap` (``malloc_trim(0)``) after loading and after warm-up returns it:
  63 MB and 15.4 MB, i.e. weights plus about 1.2-1.4 MB of fixed per-session overhead.
- **Memory pattern planning** (``enable_mem_pattern``) pre-allocates one block sized for every
  intermediate tensor of a run at the last shapes seen, on top of what the arena already holds:
  about 4 MB per segment at 1 x 128 for no measurable speed-up (min of 20 runs 14.1 vs 14.2 ms
  per segment). It is **off**.
- **The CPU arena** (``enable_cpu_mem_arena``) stays **on**: it holds the activation workspace
  between runs (about 7 MB per segment at 1 x 128, 2 MB at 3 x 16), which is memory the segment
  really uses on every request. With it off, glibc keeps the same freed activations anyway
  (78-87 MB for segment 0 after 20 runs) unless every large allocation is forced to ``mmap``,
  which made runs 40% slower (14 -> 20 ms).
- **What bounds the arena while serving** is the deployment's planned shapes: every frame is
  checked against the signed manifest's limits (:func:`edge_agent.runtime.checks.check_planned`) and
  the stage's batching never stacks past them, so the arena holds at most the workspace of the
  largest allowed run. Measured on the whole MiniLM after runs at 2 x 256, 4 x 128, 64 x 8 and
  1 x 200 tokens: arena on +46 MiB; arena off +150 MiB (glibc keeps the freed activations of
  mixed shapes, +4.7 MiB after ``malloc_trim``); a process-wide arena registered with a
  ``max_mem`` (``session.use_env_allocators``) did not cap what it held (30 MiB: still +46 MiB;
  60 MiB: a run failed), so it is not used.
- **Pre-packing** stays **on**: disabling it (``session.disable_prepacking``) saves nothing once
  the freed originals are trimmed, and made runs 10-30% slower (14 -> 15-19 ms).
- **Loading from a path, not bytes**: ORT's Python session keeps a reference to model bytes for
  its lifetime, which would double the segment's resident memory;
  ``session.use_ort_model_bytes_directly`` applies only to ORT-format models, not ONNX.
- **What is not steady state**: while a session is created, the parsed protobuf and ORT's copies
  of the weights coexist, so resident memory peaks at about 1.75x the weights (110 MB for
  segment 0) before the protobuf is freed. :func:`peak_resident_bytes` reports that peak; the
  budget is checked against what stays resident.

The partitioner's memory model (``partitioner.analysis.runtime_memory``) predicts exactly these
parts: weights, the fixed per-session overhead, and the arena's share of the activation workspace.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from edge_agent.config import RuntimeConfig
from edge_agent.errors import ExecutionError, InputMismatchError, SegmentLoadError
from edge_agent.protobuf.writer import matmul_model_bytes
from edge_agent.runtime.batching import batch_axis_symbol
from edge_agent.runtime.checks import Array, InputSpec
from protocols.frames import DTYPES


def session_options(runtime: RuntimeConfig) -> Any:
    """Session options with the configured thread counts (so agents on one host share cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = runtime.intra_op_threads
    options.inter_op_num_threads = runtime.inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_mem_pattern = False  # see the module docstring: ~4 MB a segment, no speed-up
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def resident_bytes() -> int:
    """This process's resident set size."""
    return int(psutil.Process().memory_info().rss)


@functools.cache
def _malloc_trim() -> Any:
    """The C library's ``malloc_trim`` (glibc), or None where it has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_heap() -> None:
    """Hand memory the C heap holds but no longer uses back to the OS (``malloc_trim(0)``).

    Without it, the protobuf ORT freed after copying the weights out stays resident and the
    agent's resident memory says nothing about what its segments use. A no-op off glibc.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def reset_peak_resident() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux ``clear_refs``); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as out:
            out.write("5")
    except OSError:
        return False
    return True


def peak_resident_bytes() -> int | None:
    """Peak resident set size since the last :func:`reset_peak_resident` (Linux), else None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


WARMUP_MIN_S = 0.2
"""Warm-ups of short stages go on at least this long (the median of more runs is steadier)."""
WARMUP_MAX_RUNS = 50


@dataclass
class SegmentSession:
    """A loaded segment: its ORT session and declared inputs and outputs."""

    session: Any
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    resident_added: int
    load_s: float

    @classmethod
    def load(cls, path: Path, runtime: RuntimeConfig) -> SegmentSession:
        """Parse and load a segment file (only after its hash and signature were verified).

        Loading from a file, not bytes: ORT's Python session keeps a reference to model bytes
        for its lifetime, which would double the segment's resident memory. The heap freed
        while loading (the parsed protobuf, pre-packed weights' originals) is returned to the
        OS before ``resident_added`` is measured.
        """
        import onnxruntime as ort

        release_freed_heap()
        before = resident_bytes()
        start = time.perf_counter()
        try:
            session = ort.InferenceSession(
                str(path), session_options(runtime), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own pybind classes for bad protobuf/graphs
            raise SegmentLoadError(f"ONNX Runtime cannot load the segment: {exc}") from exc
        load_s = time.perf_counter() - start
        release_freed_heap()
        try:
            inputs = tuple(
                InputSpec.from_ort(arg.name, arg.type, arg.shape) for arg in session.get_inputs()
            )
        except InputMismatchError as exc:
            raise SegmentLoadError(str(exc)) from exc
        outputs = tuple(arg.name for arg in session.get_outputs())
        return cls(session, inputs, outputs, resident_bytes() - before, load_s)

    def batch_axis(self) -> str | None:
        """The symbol of the free first axis shared by every input and output, if any."""
        shapes = [arg.shape for arg in self.session.get_outputs()]
        return batch_axis_symbol(self.inputs, shapes)

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run the segment (blocking; call from a worker thread)."""
        try:
            values = self.session.run(list(self.outputs), feeds)
        except Exception as exc:  # ORT raises its own pybind classes
            raise ExecutionError(f"ONNX Runtime failed: {exc}") from exc
        return dict(zip(self.outputs, values, strict=True))

    def warm_up(
        self,
        feeds: dict[str, Array] | None,
        shapes: dict[str, list[int]],
        runs: int,
        threads: int = 1,
    ) -> tuple[float, float]:
        """Run ``1 + runs`` times on ``feeds`` (or all-ones inputs shaped by ``shapes``).

        Short stages run on until :data:`WARMUP_MIN_S` have passed (at most
        :data:`WARMUP_MAX_RUNS` runs), so a sub-millisecond stage's median is over enough runs
        to be stable. Returns (first run, median of the others) in seconds: the steady-state
        stage time.
        With one intra-op thread ONNX Runtime runs on the calling thread, so each run counts
        the smaller of its wall time and the thread's CPU time: the time the stage really
        took, not the time other processes on the same cores held it off (agents sharing a
        machine warm up at once). Afterwards the heap freed by the runs is returned to the
        OS, so what stays resident is the weights, the session and the arena's activation
        workspace at these shapes.
        """
        if feeds is None:
            feeds = {}
            for spec in self.inputs:
                default = [d if isinstance(d, int) else 1 for d in spec.shape]
                feeds[spec.name] = np.ones(shapes.get(spec.name) or default, DTYPES[spec.dtype])
        times: list[float] = []
        began = time.perf_counter()
        while len(times) < runs + 1 or (
            len(times) < WARMUP_MAX_RUNS and time.perf_counter() - began < WARMUP_MIN_S
        ):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                self.run(feeds)
            except ExecutionError as exc:
                raise SegmentLoadError(f"warm-up failed: {exc}") from exc
            wall = time.perf_counter() - start
            times.append(min(wall, time.thread_time() - cpu) if threads == 1 else wall)
        release_freed_heap()
        return times[0], statistics.median(times[1:]) if runs else times[0]


def model_session(model: bytes, runtime: RuntimeConfig) -> Any:
    """A CPU session of a small serialized model (a benchmark's or a probe's) with the
    configured session options."""
    import onnxruntime as ort

    return ort.InferenceSession(model, session_options(runtime), providers=["CPUExecutionProvider"])


def prime(runtime: RuntimeConfig) -> None:
    """Create and run one tiny session, so ONNX Runtime's one-off start-up memory (environment,
    thread pools) is part of the agent's baseline, not charged to the first segment loaded."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        matmul_model_bytes(8, 1), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    eye = np.eye(8, dtype=np.float32)
    session.run(None, {"x": eye, "w": eye})
    del session
    release_freed_heap()
