"""What a split works from: the analysed model (:class:`Analysis`) and its options
(:class:`SplitOptions`).

Below :mod:`partitioner.cutting.split`, :mod:`partitioner.cutting.segment_files` and
:mod:`partitioner.cutting.manifests`, which all read them, so none of those imports another
for its types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from partitioner.analysis.costs import ShapeTable
from partitioner.analysis.decoding import DecoderLayout
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.analysis.runtime_memory import RuntimeMemory
from partitioner.analysis.samples import Samples
from partitioner.analysis.units import DEFAULT_MAX_UNITS, UnitPlan
from partitioner.cutting.calibrate import DEFAULT_RUNS, DEFAULT_THREADS
from protocols.constants import DEFAULT_QUEUE_DEPTH
from protocols.manifest import DEFAULT_SESSIONS, SessionLimits
from protocols.plan import Objective


@dataclass(frozen=True)
class Analysis:
    """Everything known about a model before planning."""

    model: onnx.ModelProto
    index: GraphIndex
    table: ShapeTable
    frontier: Frontier
    units: UnitPlan
    samples: Samples
    samples_source: str
    """``"given"``, ``"embedded"`` (front door metadata) or ``"synthesised"``."""
    decoder: DecoderLayout | None = None
    """The model's per-session state (KV cache), if it has any."""


@dataclass(frozen=True)
class SplitOptions:
    """Knobs of :func:`~partitioner.cutting.split.split_model` (the CLI flags)."""

    objective: Objective = Objective.THROUGHPUT
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    verify: bool = False
    tolerance: float | None = None
    """For ``verify``: largest accepted difference; None: by the model's compute precision
    (:func:`partitioner.cutting.verify.default_tolerance`)."""
    dims: Mapping[str, int] = field(default_factory=dict)
    samples_path: Path | None = None
    max_units: int = DEFAULT_MAX_UNITS
    carry_io: bool | None = None
    """Hand model inputs and outputs along the chain (True) or let each segment read and emit
    its own (False); None: direct for a model with per-session state, carried otherwise."""
    external_threshold_bytes: int | None = None
    calibrate: bool = False
    """Time every unit in ONNX Runtime and plan with the measured distribution of compute."""
    calibration_runs: int = DEFAULT_RUNS
    calibration_threads: int = DEFAULT_THREADS
    runtime: RuntimeMemory = field(default_factory=RuntimeMemory)
    """What the agent's ONNX Runtime keeps resident per segment beyond weights and queued
    frames; predicted memory includes it (see :mod:`partitioner.analysis.runtime_memory`)."""
    sessions: SessionLimits = DEFAULT_SESSIONS
    """For a model with per-session state: the KV cache every stage reserves memory for."""
    segment_cache: Path | None = None
    """Keep segment files here and reuse them when the same model is cut the same way."""
    work_scales: Sequence[float] | None = None
    """How many times its roofline work each unit is priced at (measured against predicted
    on the devices before, see ``coordinator.deploy.unit_residuals``); ignored unless there is
    one per unit."""
