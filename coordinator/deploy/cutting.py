"""The partitioner's side of a deploy: plan and cut a model, or read a cut version, and run its
segments here on the model's samples (warm-up inputs and the health check's expected answer).

Partitioner errors become :class:`~coordinator.errors.DeployError`. The
:class:`~coordinator.deploy.deployer.Deployer` pushes what this module produced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.deploy.limits import (
    at_binding,
    keeping_sequence,
    planned_limits,
    planning_ladder,
    rungs_by_quality,
)
from coordinator.deploy.stage_timing import CALIBRATION_RUNS, calibrates_at_deploy
from coordinator.errors import DeployError, NoFitError
from coordinator.generation.feeds import health_feeds, state_names
from partitioner.planning.baselines import Baseline
from protocols.decoder import DECODER_FILE, DecoderInfo
from protocols.deploy import ShapeLimits
from protocols.errors import SchemaError
from protocols.gguf_card import GgufCard, WeightsMode
from protocols.manifest import Manifest
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem, Work

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray[Any, Any]]


@dataclass(frozen=True)
class DeployCommand:
    """What the operator asked for."""

    model_path: Path
    model_id: str
    objective: Objective = Objective.THROUGHPUT
    memory_caps: Mapping[str, int] = field(default_factory=dict)
    """Per-device planning caps in bytes (at most the agent's free budget is used anyway)."""
    tokenizer_dir: str | None = None
    trigger: str = "operator"
    """Why this version is deployed: ``operator``, or ``failover: ...``/``expand: ...``."""
    strict_caps: bool = True
    """Refuse caps naming devices that are not online (False for re-plans: the operator's caps
    stay with the model while a device is away)."""
    baseline: Baseline | None = None
    """Cut the way a baseline does (exo's memory-weighted split, an even split) instead of
    planning, to compare against the plan; None (the default) plans."""
    weights: WeightsMode = "keep"
    """A GGUF file's weights in its segments: the file's own types (``keep``) or re-quantized
    (``int4``, ``int8``); ignored for an ONNX model."""


@dataclass(frozen=True)
class SplitOutcome:
    """The partitioner's result as the deployer needs it."""

    manifest: Manifest
    segment_dir: Path
    samples: Arrays
    warmups: list[Arrays]
    expected: Arrays
    limits: ShapeLimits | None = None
    """The planned shapes every stage enforces (see :mod:`coordinator.deploy.limits`)."""
    unit_work: tuple[Work, ...] = ()
    """The planned phase's work of every planning unit (empty when not planned here or not
    priced by the roofline): what each stage's prediction is made of."""
    tokenizer_dir: Path | None = None
    """Where the deploy wrote the model's tokenizer and ``decoder.json`` (a GGUF file's, built
    from its metadata); None: the command's tokenizer directory stands."""
    card: GgufCard | None = None
    """What a GGUF file is and what building its segments cost (None for an ONNX model)."""


def version_outcome(version_dir: Path, out: Path, samples: Arrays) -> SplitOutcome:
    """Run a cut version (copied to ``out``) here on ``samples``: warm-ups and the expected
    answer. For a decoder (``sessions`` in the manifest) ``samples`` needs only ``input_ids``:
    the health check is a one-shot prefill, as for :func:`split_and_run`."""
    from partitioner.cutting.verify import run_chain
    from partitioner.errors import PartitionerError

    try:
        manifest = Manifest.from_json((out / "manifest.json").read_bytes())
        files = [out / s.file for s in manifest.segments]
        wire = dict(samples)
        if manifest.sessions is not None:
            wire, local = health_feeds(manifest, samples)
            known = run_chain(files, local)
        else:
            known = run_chain(files, wire)
    except (SchemaError, OSError, PartitionerError, KeyError) as exc:
        raise DeployError(f"cannot read version {version_dir}: {exc}") from exc
    state = state_names(manifest)
    return SplitOutcome(
        manifest,
        out,
        wire,
        [{n: known[n] for n in s.inputs} for s in manifest.segments],
        {o.name: known[o.name] for o in manifest.model.outputs if o.name not in state},
    )


def split_and_run(
    command: DeployCommand,
    devices: Any,
    out: Path,
    segment_cache: Path | None = None,
    work_scales: Sequence[float] | None = None,
) -> SplitOutcome:
    """Plan and cut with the partitioner, then run the segments here on the model's samples.

    Segments cut the same way before come from ``segment_cache`` when one is given; each
    unit's work is priced ``work_scales`` times (the residuals of earlier deploys).
    The local run gives each segment a real warm-up input and the health check its expected
    answer. Partitioner errors become DeployError.
    """
    from partitioner.cutting.split import analysis_work
    from partitioner.cutting.verify import run_chain
    from partitioner.errors import InfeasiblePlanError, PartitionerError

    try:
        result = _split_at_serving_shapes(command, devices, out, segment_cache, work_scales)
        samples = dict(result.analysis.samples)
        known = run_chain([w.files[0] for w in result.segments], samples)
    except InfeasiblePlanError as exc:
        raise NoFitError(f"cannot plan or split {command.model_path.name}: {exc}") from exc
    except (PartitionerError, OSError) as exc:
        raise DeployError(f"cannot plan or split {command.model_path.name}: {exc}") from exc
    manifest = result.manifest
    binding = _input_binding(manifest, result.analysis.table.dims)
    serving = at_binding(manifest.model.inputs, samples, binding) if not manifest.sessions else None
    try:
        warm = (
            known if serving is None else run_chain([w.files[0] for w in result.segments], serving)
        )
    except PartitionerError as exc:
        raise DeployError(
            f"cannot run {command.model_path.name} at its planned shapes: {exc}"
        ) from exc
    warmups = [{n: warm[n] for n in s.inputs} for s in manifest.segments]
    if manifest.sessions is not None:  # a decoder: the health check is a one-shot prefill
        samples, local = health_feeds(manifest, samples)
        known = run_chain([w.files[0] for w in result.segments], local)
    state = state_names(manifest)
    expected = {o.name: known[o.name] for o in manifest.model.outputs if o.name not in state}
    limits = planned_limits(manifest, binding)
    unit_work = tuple(analysis_work(result.analysis))  # unscaled: the terms fitted on
    return SplitOutcome(manifest, out, samples, warmups, expected, limits, unit_work)


def _split_at_serving_shapes(
    command: DeployCommand,
    devices: Any,
    out: Path,
    segment_cache: Path | None,
    work_scales: Sequence[float] | None,
) -> Any:
    """Plan and cut at the serving shapes with the best plan the devices can hold (see
    :func:`coordinator.deploy.limits.rungs_by_quality`): they become the deployment's limits.
    A baseline cut takes the largest shapes that fit."""
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model
    from partitioner.errors import InfeasiblePlanError

    planner = None if command.baseline is None else baseline_planner(command.baseline)
    ladder = planning_ladder(command.tokenizer_dir)
    if planner is None and len(ladder) > 1:
        ladder = rungs_by_quality(ladder, _plan_times(command, devices, ladder))
    for rung, dims in enumerate(ladder, start=1):
        options = SplitOptions(
            command.objective,
            segment_cache=segment_cache,
            calibrate=calibrates_at_deploy(command.model_path, devices),
            calibration_runs=CALIBRATION_RUNS,
            dims=dims,
            work_scales=work_scales,
        )
        try:
            return split_model(command.model_path, devices, out, options, planner=planner)
        except InfeasiblePlanError as exc:
            if rung == len(ladder):
                raise
            log.info(
                "%s does not fit at %s (%s); planning smaller runs", command.model_id, dims, exc
            )
    raise AssertionError("unreachable")  # the ladder has at least one rung


def _plan_times(
    command: DeployCommand, devices: Any, ladder: list[dict[str, int]]
) -> list[tuple[float, float] | None]:
    """Each sequence-keeping rung's plan seconds, under the command's objective and under the
    other one (None where the devices cannot hold it), planned without cutting: an analysis
    and a plan take milliseconds for a text encoder."""
    from partitioner.analysis.modelio import load_model
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import analyse, choose_plan, planning_problem
    from partitioner.errors import InfeasiblePlanError

    model = load_model(command.model_path)
    times: list[tuple[float, float] | None] = []
    for dims in keeping_sequence(ladder):
        options = SplitOptions(command.objective, dims=dims)
        analysis = analyse(model, dims=options.dims)
        problem = planning_problem(analysis, devices, options, command.model_path.stem)
        try:
            plan = choose_plan(problem, options, analysis)
        except InfeasiblePlanError:
            times.append(None)
            continue
        log.info(
            "%s at %s: bottleneck %.1f ms, latency %.1f ms",
            command.model_id,
            dims,
            plan.bottleneck_s * 1e3,
            plan.latency_s * 1e3,
        )
        pair = (plan.bottleneck_s, plan.latency_s)
        times.append(pair[::-1] if command.objective is Objective.LATENCY else pair)
    return times


def _input_binding(manifest: Manifest, binding: Mapping[str, int]) -> dict[str, int]:
    """The sizes the model inputs' symbolic dimensions were planned at."""
    symbols = {d for i in manifest.model.inputs for d in i.shape if isinstance(d, str)}
    return {name: int(size) for name, size in binding.items() if name in symbols}


def baseline_planner(baseline: Baseline) -> Callable[[PlanningProblem, Objective], Plan]:
    """A planner that splits the way ``baseline`` does; InfeasiblePlanError when a stage of
    that split does not fit its device (baselines do not look at memory)."""
    from partitioner.errors import InfeasiblePlanError
    from partitioner.planning.baselines import run_baseline

    def choose(problem: PlanningProblem, objective: Objective) -> Plan:
        result = run_baseline(problem, objective, baseline)
        if result.overflows:
            over = ", ".join(f"{device} by {size} bytes" for device, size in result.overflows)
            shortfall = max(size for _, size in result.overflows)
            raise InfeasiblePlanError(f"the {baseline} split overflows {over}", shortfall)
        return result.plan

    return choose


def refuse_draft_only(model_path: Path) -> None:
    """:class:`DeployError` when ``model_path`` belongs to a draft-only decoder export
    (``fedshard export --draft``: its head scores only some tokens, so it may draft for a
    served model but would generate wrong text itself)."""
    info_file = model_path.parent / DECODER_FILE
    if not info_file.is_file():
        return
    try:
        info = DecoderInfo.from_json(info_file.read_bytes())
    except SchemaError as exc:
        raise DeployError(f"cannot read {info_file}: {exc}") from exc
    if info.draft_vocabulary is not None:
        raise DeployError(
            f"{model_path.parent} is a draft-only export (its output head scores "
            f"{info.draft_vocabulary} of {info.vocab_size} tokens): use it as a deployment's "
            "draft_model, and deploy the full export"
        )
