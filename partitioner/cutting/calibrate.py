"""Optional calibration: time every planning unit in ONNX Runtime on this machine.

FLOP counts say little about what really costs time: memory-bound operators, softmax and
normalisation, gathers, sorts, transcendental element-wise functions. Calibration runs the
model cut at *every* unit boundary as a chain of per-unit segments on the sample inputs and
takes, per unit, the fastest of ``runs`` timed runs after ``warmup`` untimed ones.

Why the fastest and not the median: a unit's own work is fixed, and everything else on the
machine (other processes, preemption, frequency dips) only ever *adds* time, in bursts that hit
long units more often than short ones. On a busy two-core machine the medians of identical
transformer layers differed by up to 6x between runs while their minima agreed within about
15%. The median is still kept, to show how noisy the machine was.

The measured times replace only the *distribution* of compute over the units, not the devices'
speeds: a unit's compute on a device becomes the model's FLOPs over the device's GFLOP/s (as
rated in ``DEVICES.json``) times the unit's measured share of the model's time (see
:func:`partitioner.planning.problem_from_graph.build_problem`). Each device keeps its rating, the
partitioner needs no GFLOP/s measurement of its own, and the expensive units are the ones that
really are.

Units are timed one at a time, one ONNX Runtime session alive at once, so calibration needs
memory for the largest unit's weights plus the sample's activations, not for the whole model.
Sessions use the edge agent's defaults: ``threads`` intra-op threads (1 unless told), sequential
execution, all graph optimisations, no memory pattern, no spinning.

:func:`shares_of` and :class:`Calibration` are pure; :func:`time_chain` is the ONNX Runtime
layer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.errors import CalibrationError

DEFAULT_RUNS = 10
DEFAULT_WARMUP = 1
DEFAULT_THREADS = 1


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit on this machine, next to the units' FLOP estimates."""

    names: tuple[str, ...]
    flops: tuple[int, ...]
    seconds: tuple[float, ...]
    """Fastest wall time of each unit's segment over ``runs`` runs: what the plan uses."""
    median_seconds: tuple[float, ...]
    """Median wall time of each unit (far above ``seconds`` when the machine was busy)."""
    runs: int
    threads: int

    def __post_init__(self) -> None:
        counts = {len(self.flops), len(self.seconds), len(self.median_seconds)}
        if counts != {len(self.names)}:
            raise CalibrationError(
                f"{len(self.names)} units but {len(self.flops)} FLOP counts and "
                f"{len(self.seconds)}/{len(self.median_seconds)} times"
            )

    @classmethod
    def from_samples(
        cls,
        names: Sequence[str],
        flops: Sequence[int],
        samples: Sequence[Sequence[float]],
        *,
        threads: int,
    ) -> Calibration:
        """Summarise each unit's timed runs (as from :func:`time_chain`)."""
        if any(len(s) == 0 for s in samples):
            raise CalibrationError("a unit has no timed runs")
        return cls(
            names=tuple(names),
            flops=tuple(flops),
            seconds=tuple(min(s) for s in samples),
            median_seconds=tuple(float(statistics.median(s)) for s in samples),
            runs=min((len(s) for s in samples), default=0),
            threads=threads,
        )

    @property
    def shares(self) -> tuple[float, ...]:
        """Each unit's share of the measured time (sums to 1)."""
        return tuple(shares_of(self.seconds))

    @property
    def flop_shares(self) -> tuple[float, ...]:
        """Each unit's share of the model's FLOPs (all zero for a model of no FLOPs)."""
        total = sum(self.flops)
        return tuple(f / total if total else 0.0 for f in self.flops)

    @property
    def total_s(self) -> float:
        """Sum of the units' median times: the chain's time on this machine."""
        return math.fsum(self.seconds)


def shares_of(values: Sequence[float]) -> list[float]:
    """``values`` normalised to sum to 1.

    Raises :class:`CalibrationError` if a value is negative or not finite, or all are zero.
    """
    bad = [v for v in values if not math.isfinite(v) or v < 0]
    if bad:
        raise CalibrationError(f"unit times must be finite and non-negative, got {bad[:3]}")
    total = math.fsum(values)
    if total <= 0:
        raise CalibrationError("every unit took zero time; nothing to calibrate against")
    return [v / total for v in values]


def time_chain(
    segments: Sequence[Path],
    feeds: Mapping[str, np.ndarray],
    *,
    runs: int = DEFAULT_RUNS,
    warmup: int = DEFAULT_WARMUP,
    threads: int = DEFAULT_THREADS,
) -> list[list[float]]:
    """Seconds of each timed run of each segment file, run in order as a chain.

    Each segment is fed by name from ``feeds`` and earlier segments' outputs, run ``warmup``
    times untimed and ``runs`` times timed, and closed before the next is loaded. Raises
    :class:`CalibrationError` if a segment cannot be loaded or run.
    """
    if runs < 1 or warmup < 0 or threads < 1:
        raise CalibrationError(
            f"need runs >= 1, warmup >= 0 and threads >= 1 (got {runs}, {warmup}, {threads})"
        )
    known: dict[str, np.ndarray] = dict(feeds)
    samples: list[list[float]] = []
    for path in segments:
        session = _session(path, threads)
        names = [i.name for i in session.get_inputs()]
        missing = [n for n in names if n not in known]
        if missing:
            raise CalibrationError(f"{path.name}: no value for inputs {missing}")
        args = {n: known[n] for n in names}
        outputs = [o.name for o in session.get_outputs()]
        for _ in range(warmup):
            _run(session, path, outputs, args)
        times: list[float] = []
        values: list[Any] = []
        for _ in range(runs):
            start = time.perf_counter()
            values = _run(session, path, outputs, args)
            times.append(time.perf_counter() - start)
        samples.append(times)
        known.update((n, np.asarray(v)) for n, v in zip(outputs, values, strict=True))
        del session
    return samples


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.enable_mem_pattern = False  # as on the edge agent (edge_agent.runtime.engine)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ONNX Runtime's errors derive from Exception only
        raise CalibrationError(f"{path.name}: ONNX Runtime cannot load it: {exc}") from exc


def _run(session: Any, path: Path, outputs: list[str], args: Mapping[str, Any]) -> list[Any]:
    try:
        values: list[Any] = session.run(outputs, dict(args))
    except Exception as exc:  # ONNX Runtime's errors derive from Exception only
        raise CalibrationError(f"{path.name}: ONNX Runtime failed to run it: {exc}") from exc
    return values
