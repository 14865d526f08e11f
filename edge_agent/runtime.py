"""ONNX Runtime: session options, loading a segment with its memory measured, warm-up, runs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from edge_agent.checks import Array, InputSpec
from edge_agent.config import RuntimeConfig
from edge_agent.errors import ExecutionError, InputMismatchError, SegmentLoadError
from protocols.frames import DTYPES


def session_options(runtime: RuntimeConfig) -> Any:
    """Session options with the configured thread counts (so agents on one host share cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = runtime.intra_op_threads
    options.inter_op_num_threads = runtime.inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def resident_bytes() -> int:
    """This process's resident set size."""
    return int(psutil.Process().memory_info().rss)


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
        for its lifetime, which would double the segment's resident memory.
        """
        import onnxruntime as ort

        before = resident_bytes()
        start = time.perf_counter()
        try:
            session = ort.InferenceSession(
                str(path), session_options(runtime), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # ORT raises its own pybind classes for bad protobuf/graphs
            raise SegmentLoadError(f"ONNX Runtime cannot load the segment: {exc}") from exc
        load_s = time.perf_counter() - start
        try:
            inputs = tuple(
                InputSpec.from_ort(arg.name, arg.type, arg.shape) for arg in session.get_inputs()
            )
        except InputMismatchError as exc:
            raise SegmentLoadError(str(exc)) from exc
        outputs = tuple(arg.name for arg in session.get_outputs())
        return cls(session, inputs, outputs, resident_bytes() - before, load_s)

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run the segment (blocking; call from a worker thread)."""
        try:
            values = self.session.run(list(self.outputs), feeds)
        except Exception as exc:  # ORT raises its own pybind classes
            raise ExecutionError(f"ONNX Runtime failed: {exc}") from exc
        return dict(zip(self.outputs, values, strict=True))

    def warm_up(
        self, feeds: dict[str, Array] | None, shapes: dict[str, list[int]], runs: int
    ) -> tuple[float, float]:
        """Run ``1 + runs`` times on ``feeds`` (or all-ones inputs shaped by ``shapes``).

        Returns (first run, median of the others) in seconds.
        """
        if feeds is None:
            feeds = {}
            for spec in self.inputs:
                default = [d if isinstance(d, int) else 1 for d in spec.shape]
                feeds[spec.name] = np.ones(shapes.get(spec.name) or default, DTYPES[spec.dtype])
        times = []
        for _ in range(runs + 1):
            start = time.perf_counter()
            try:
                self.run(feeds)
            except ExecutionError as exc:
                raise SegmentLoadError(f"warm-up failed: {exc}") from exc
            times.append(time.perf_counter() - start)
        return times[0], statistics.median(times[1:]) if runs else times[0]


def prime(runtime: RuntimeConfig) -> None:
    """Create and run one tiny session, so ONNX Runtime's one-off start-up memory (environment,
    thread pools) is part of the agent's baseline, not charged to the first segment loaded."""
    import onnxruntime as ort

    from edge_agent.microbench import matmul_model_bytes

    session = ort.InferenceSession(
        matmul_model_bytes(8, 1), session_options(runtime), providers=["CPUExecutionProvider"]
    )
    eye = np.eye(8, dtype=np.float32)
    session.run(None, {"x": eye, "w": eye})
