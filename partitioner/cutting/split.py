"""``fedshard split`` end to end: analyse, plan, cut, write segments and manifest, verify.

:func:`analyse` is ``ModelProto`` in, data out; :func:`write_segments` and :func:`split_model`
are the file-writing layer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from hostkit.files import file_sha256
from partitioner.analysis.decoding import (
    decoder_layout,
    describe_state,
    replicated_inputs,
    unit_state_bytes,
)
from partitioner.analysis.frontier import build_frontier
from partitioner.analysis.graph import index_graph
from partitioner.analysis.modelio import load_model
from partitioner.analysis.phases import prefill_work
from partitioner.analysis.roofline import scaled_work, unit_work
from partitioner.analysis.samples import (
    Samples,
    check_samples,
    embedded_samples,
    load_npz,
    synthesize,
)
from partitioner.analysis.shapes import infer_shapes
from partitioner.analysis.units import DEFAULT_MAX_UNITS, UnitPlan, build_units
from partitioner.cutting.calibrate import (
    DEFAULT_RUNS,
    DEFAULT_THREADS,
    Calibration,
    time_chain,
)
from partitioner.cutting.inputs import Analysis, SplitOptions
from partitioner.cutting.manifests import build_manifest
from partitioner.cutting.segment_files import WrittenSegment, cached_cuts, write_segments
from partitioner.cutting.verify import VerifyResult, default_tolerance, verify_chain
from partitioner.errors import GraphError, InfeasiblePlanError
from partitioner.planning.planner import plan_preferring_one_device
from partitioner.planning.problem_from_graph import build_problem
from protocols.devices import DeviceList
from protocols.manifest import MANIFEST_FILE, Manifest, SessionLimits
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem, Work

Planner = Callable[[PlanningProblem, Objective], Plan]


@dataclass(frozen=True)
class SplitResult:
    """What :func:`split_model` did."""

    manifest: Manifest
    plan: Plan
    problem: PlanningProblem
    analysis: Analysis
    segments: tuple[WrittenSegment, ...]
    verification: VerifyResult | None = None
    calibration: Calibration | None = None
    """Per-unit times on this machine when the split was calibrated."""
    flop_plan: Plan | None = None
    """When calibrated: the plan FLOP estimates alone would have given (for comparison)."""


def analyse(
    model: onnx.ModelProto,
    *,
    dims: Mapping[str, int] | None = None,
    samples: Samples | None = None,
    max_units: int = DEFAULT_MAX_UNITS,
    carry_io: bool | None = None,
) -> Analysis:
    """Index, size and cost the graph and group it into planning units.

    Shapes for costing are bound from ``dims`` by dimension name, then from ``samples`` (else
    the model's embedded samples), then defaults: ``dims`` wins, so a model can be costed at
    its deployment's shapes (batch 1 x 128 tokens, say) and still verified on small samples.
    Without samples, inputs are synthesised at that binding. ``carry_io=None`` analyses a model
    with per-session state (see :mod:`partitioner.analysis.decoding`) with direct I/O, keeping each
    layer's state on its stage, and any other model with carried I/O.
    """
    layout = decoder_layout(model) if carry_io is not True else None
    replicated = replicated_inputs(model, layout) if layout is not None else frozenset()
    carry_io = layout is None if carry_io is None else carry_io
    index = index_graph(model.graph, replicated_inputs=replicated)
    source = "given"
    given = samples
    if given is None:
        given = embedded_samples(model)
        source = "embedded"
    if given is not None:
        given = {n: given[n] for n in index.inputs if n in given}
        check_samples(index, given)
    concrete = _sample_shapes(model, given, dims or {}) if given else None
    table = infer_shapes(model, index, dims or {}, concrete)
    if given is None:
        given, source = synthesize(index, table), "synthesised"
    frontier = build_frontier(index, table, carry_io=carry_io)
    if frontier.size == 0:
        raise GraphError("nothing to split: every node of the model is a constant")
    units = build_units(index, frontier, table, max_units=max_units)
    return Analysis(model, index, table, frontier, units, given, source, layout)


def _sample_shapes(
    model: onnx.ModelProto, samples: Samples, dims: Mapping[str, int]
) -> dict[str, tuple[int, ...]]:
    """The samples' input shapes, with every axis declared as a symbol in ``dims`` rebound."""
    declared = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, array in samples.items():
        axes = list(declared.get(name, []))
        shapes[name] = tuple(
            dims.get(axes[k].dim_param, size) if k < len(axes) and axes[k].dim_param else size
            for k, size in enumerate(array.shape)
        )
    return shapes


def unit_cuts(units: UnitPlan, plan: Plan) -> list[int]:
    """Main-node cut positions for the plan's stages (which must cover every unit in order)."""
    expected = 0
    for stage in plan.stages:
        if stage.start != expected or stage.end <= stage.start:
            raise GraphError(f"plan stages do not tile the units: {plan.stages}")
        expected = stage.end
    if expected != len(units.units):
        raise GraphError(f"plan covers {expected} of {len(units.units)} units")
    return [units.boundaries[s.start] for s in plan.stages] + [units.boundaries[-1]]


def calibrate_units(
    analysis: Analysis,
    scratch: Path,
    *,
    source_dir: Path | None = None,
    runs: int = DEFAULT_RUNS,
    threads: int = DEFAULT_THREADS,
) -> Calibration:
    """Time every unit of ``analysis`` on its samples (see :mod:`partitioner.cutting.calibrate`).

    The per-unit segments are written to a temporary directory inside ``scratch`` (so a large
    model's copy lands next to its real segments, not in ``/tmp``) and removed afterwards.
    Raises :class:`~partitioner.errors.CalibrationError`.
    """
    units = analysis.units
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fedshard-calibrate-", dir=scratch) as tmp:
        written = write_segments(analysis, units.boundaries, Path(tmp), source_dir=source_dir)
        samples = time_chain(
            [w.files[0] for w in written], analysis.samples, runs=runs, threads=threads
        )
    return Calibration.from_samples(
        [u.name for u in units.units], [u.flops for u in units.units], samples, threads=threads
    )


def split_model(
    model_path: Path,
    devices: DeviceList,
    out_dir: Path,
    options: SplitOptions | None = None,
    *,
    planner: Planner | None = None,
) -> SplitResult:
    """Plan ``model_path`` onto ``devices``, write the segments and manifest into ``out_dir``.

    With ``options.calibrate`` every unit is first timed on this machine and the plan (and the
    manifest's predicted compute) uses the measured distribution of compute over the units.
    With ``options.verify`` the segments are run as a chain against the whole model before the
    manifest is written. Raises :class:`~partitioner.errors.InfeasiblePlanError`,
    :class:`~partitioner.errors.GraphError` (of which
    :class:`~partitioner.errors.CalibrationError`) or
    :class:`~partitioner.errors.VerificationError`.
    """
    opts = options or SplitOptions()
    model = load_model(model_path)
    given = load_npz(opts.samples_path) if opts.samples_path else None
    analysis = analyse(
        model, dims=opts.dims, samples=given, max_units=opts.max_units, carry_io=opts.carry_io
    )
    problem = planning_problem(analysis, devices, opts, model_path.stem)
    plan = choose_plan(problem, opts, analysis, planner)  # an infeasible model fails before timing
    calibration = flop_plan = None
    if opts.calibrate:
        calibration = calibrate_units(
            analysis,
            out_dir,
            source_dir=model_path.parent,
            runs=opts.calibration_runs,
            threads=opts.calibration_threads,
        )
        problem = planning_problem(analysis, devices, opts, model_path.stem, calibration.shares)
        flop_plan, plan = plan, choose_plan(problem, opts, analysis, planner)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)
    model_sha256 = file_sha256(model_path)
    written = write_segments(
        analysis,
        unit_cuts(analysis.units, plan),
        out_dir,
        source_dir=model_path.parent,
        external_threshold_bytes=opts.external_threshold_bytes,
        cache=cached_cuts(opts, model_sha256, analysis.model),
    )
    result = None
    if opts.verify:
        result = verify_chain(
            model_path,
            [w.files[0] for w in written],
            [analysis.samples],
            default_tolerance(analysis.model) if opts.tolerance is None else opts.tolerance,
        )
    manifest = build_manifest(
        model_path, analysis, plan, written, opts.sessions, model_sha256, problem
    )
    (out_dir / MANIFEST_FILE).write_text(manifest.to_json() + "\n")
    return SplitResult(
        manifest, plan, problem, analysis, tuple(written), result, calibration, flop_plan
    )


def planning_problem(
    analysis: Analysis,
    devices: DeviceList,
    opts: SplitOptions,
    name: str,
    shares: Sequence[float] | None = None,
) -> PlanningProblem:
    """The planning problem a split of ``analysis`` onto ``devices`` solves (``shares``: the
    calibrated distribution of compute over the units, if measured)."""
    return build_problem(
        analysis.units,
        devices,
        queue_depth=opts.queue_depth,
        name=name,
        compute_shares=shares,
        runtime=opts.runtime,
        state_bytes=_state_bytes(analysis, opts.sessions),
        work=_scaled(analysis_work(analysis), opts.work_scales),
        prefill=analysis_prefill(analysis),
        phase="decode" if analysis.decoder is not None else "request",
    )


def _scaled(work: list[Work], scales: Sequence[float] | None) -> list[Work]:
    if scales is None or len(scales) != len(work):
        return work
    return [scaled_work(w, s) for w, s in zip(work, scales, strict=True)]


def analysis_work(analysis: Analysis) -> list[Work]:
    """Each unit's roofline work at the analysis's shapes (see
    :mod:`partitioner.analysis.roofline`)."""
    return unit_work(analysis.index, analysis.frontier, analysis.table, analysis.units)


def analysis_prefill(analysis: Analysis) -> list[Work] | None:
    """A decoder's per-unit prefill work (see :mod:`partitioner.analysis.phases`); None
    otherwise."""
    layout = analysis.decoder
    if layout is None:
        return None
    shapes = {name: tuple(a.shape) for name, a in analysis.samples.items()}
    a = analysis
    return prefill_work(a.model, a.index, a.frontier, a.units, layout, shapes)


def _state_bytes(analysis: Analysis, sessions: SessionLimits) -> list[int] | None:
    if analysis.decoder is None:
        return None
    return unit_state_bytes(
        analysis.index, analysis.frontier, analysis.units, analysis.decoder, sessions
    )


def choose_plan(
    problem: PlanningProblem,
    opts: SplitOptions,
    analysis: Analysis,
    choose: Planner | None = None,
) -> Plan:
    """Plan ``problem`` (with the exact planner unless ``choose`` is given); for a decoder, an
    infeasible plan's error also says what the KV cache takes."""
    choose = choose or _default_planner()
    try:
        return choose(problem, opts.objective)
    except InfeasiblePlanError as exc:
        state = _state_bytes(analysis, opts.sessions)
        if not state:
            raise
        raise InfeasiblePlanError(
            f"{exc}; {describe_state(sum(state), opts.sessions)}", exc.shortfall_bytes
        ) from exc


def _default_planner() -> Planner:
    return plan_preferring_one_device
