"""Corrections from predicted to measured stage time, learnt at every deploy.

At deploy time each agent times its own segment at the planned shapes in steady state (the
median of its warm-up runs after the first) and reports it next to the plan's prediction
(:class:`~protocols.deploy.DeployReport`), together with its operator, call and ``TopK``
costs measured again just before loading and just after the warm-up (``costs``): those move
with the load by up to 2.5x within minutes, so an agent's start-up figures say little about
the minute it warms up in. The agent's status then carries them, so the next plan is priced
with the costs of the latest deploy.

Roofline-priced devices (agents that announce a memory roof) are corrected **per term**
(:mod:`coordinator.deploy.term_fit`): every measured stage is split into its compute part
and its memory part (FLOPs or bytes over the start-up roofs, by which bounds each unit) and
its fixed part (operators, ``TopK`` elements and one call at the costs measured with its
warm-up); one factor per part, shared by the devices, is fitted on the last
:data:`STAGE_WINDOW` stages, and later plans price every device with its compute roof and its
bandwidths divided by the first two and its fixed costs multiplied by the third
(:func:`term_corrected`). One factor per device could not: a stage of many small operators and
a stage of bytes and ``TopK`` are off by different factors, and identical agents swap stages
between deploys. The factors are fitted per model: a model with measured stages of its own is
priced by factors fitted on its own latest :data:`STAGE_WINDOW` stages, a model never deployed
by those of the latest stages of any model. Models read their weights through different
kernels (4-bit ``MatMulNBits``, 8-bit integer products, float ``MatMul``): in the demo one
memory factor fitted on Qwen 1.5B int4's stages priced Gemma 3 270M int8's at 0.30-0.47x.
What a model's factors leave unexplained is kept per planning unit and prices the units' work
in its later plans (:mod:`coordinator.deploy.unit_residuals`).

Devices priced by FLOPs alone keep one correction each: the geometric mean of the
measured/predicted ratios of their last :data:`WINDOW` deploys, each taken against the
uncorrected roofs, clamped to [:data:`LOWEST`, :data:`HIGHEST`] (one odd measurement cannot
make a device look free or useless); for them the coordinator times every unit of a small
model on its own machine when it cuts it (``fedshard split --calibrate``'s path,
:func:`calibrates_at_deploy`) and spreads the FLOP time by those shares.

Both are kept in ``STATE/stage-timing.json`` (``fedshard.stage-timing/2``; files from before
the per-term fit are still read).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, ValidationError

from coordinator.deploy.plan import LiveDevice
from coordinator.deploy.store import VersionRecord
from coordinator.deploy.term_fit import (
    StageTerms,
    TermFactors,
    TermSample,
    fit_terms,
    stage_terms,
)
from coordinator.deploy.unit_residuals import UnitResiduals, unit_scales, with_stage
from protocols.base import FrozenModel
from protocols.devices import DeviceList
from protocols.problem import Roofs, Work
from protocols.roofs import roof_values, slowed_roofs

log = logging.getLogger(__name__)

FILE_NAME = "stage-timing.json"
CALIBRATE_MAX_BYTES = 256 << 20
"""Models up to this size (file plus external data) have their units timed at deploy."""
CALIBRATION_RUNS = 10
WINDOW = 5
LOWEST = 0.05
HIGHEST = 20.0
MIN_MEASURED_S = 1e-6
"""Stage times below this (1 us) are timer noise and teach nothing."""
STAGE_WINDOW = 8
"""Measured stages of one model the per-term fit keeps (all devices together)."""
MAX_STAGES = 64
"""Measured stages kept in all (the models deployed longest ago go first)."""
TIMING_FORMAT: Literal["fedshard.stage-timing/2"] = "fedshard.stage-timing/2"


@dataclass(frozen=True)
class StageTime:
    """One deployed stage: the plan's prediction and the agent's steady-state measurement."""

    device: str
    predicted_s: float
    measured_s: float
    terms: StageTerms | None = None
    """The prediction's parts, uncorrected, the fixed one at the costs the agent measured with
    the warm-up (:func:`~coordinator.deploy.term_fit.stage_terms`); None for devices priced
    by FLOPs alone."""
    plan_version: int = 0
    model: str = ""
    """The deployed model's id."""
    units: tuple[int, int] | None = None
    """The planning units the stage held (half-open), with ``unit_count`` the model's."""
    unit_count: int = 0


class DeviceTiming(FrozenModel):
    """The uncorrected measured/predicted ratios of one device's latest deploys."""

    ratios: list[PositiveFloat] = Field(default_factory=list, max_length=WINDOW)


class StageSample(FrozenModel):
    """One measured stage of a roofline-priced device, for the per-term fit."""

    device: str
    plan_version: NonNegativeInt
    compute_s: NonNegativeFloat
    memory_s: NonNegativeFloat
    fixed_s: NonNegativeFloat
    measured_s: PositiveFloat
    gemv_s: NonNegativeFloat = 0.0
    """One-row 4-bit products (absent from files written before that part was fitted)."""
    model: str = ""
    """The deployed model's id ("": written before the fit was per model)."""

    def terms(self) -> StageTerms:
        """The stage's predicted parts."""
        return StageTerms(self.compute_s, self.memory_s, self.fixed_s, self.gemv_s)


class TimingFile(FrozenModel):
    """``STATE/stage-timing.json`` (files without ``format``, from before the per-term fit,
    still read: they have no ``stages``)."""

    format: Literal["fedshard.stage-timing/2"] = TIMING_FORMAT
    devices: dict[str, DeviceTiming] = Field(default_factory=dict)
    stages: list[StageSample] = Field(default_factory=list, max_length=MAX_STAGES)
    """The latest measured stages of every roofline-priced device, oldest first (at most
    :data:`STAGE_WINDOW` a model)."""
    residuals: dict[str, UnitResiduals] = Field(default_factory=dict)
    """Per model: what its fitted factors leave unexplained, per unit."""


def correction_of(timing: DeviceTiming) -> float:
    """The geometric mean of ``timing``'s ratios, clamped; 1 without any."""
    if not timing.ratios:
        return 1.0
    mean = math.exp(math.fsum(math.log(r) for r in timing.ratios) / len(timing.ratios))
    return min(HIGHEST, max(LOWEST, mean))


def corrected(device: LiveDevice, factor: float) -> LiveDevice:
    """``device`` with its roofs scaled so every work takes ``factor`` times as long."""
    if factor == 1.0:
        return device
    slowed = slowed_roofs(device, factor, factor, factor)
    return dataclasses.replace(device, **slowed, correction=factor)


def term_corrected(device: LiveDevice, factors: TermFactors) -> LiveDevice:
    """``device`` with its compute roof slowed by ``factors.compute``, its bandwidths by
    ``factors.memory`` and its operator, call and selection costs multiplied by
    ``factors.fixed``."""
    slowed = slowed_roofs(device, factors.compute, factors.memory, factors.fixed, gemv=factors.gemv)
    return dataclasses.replace(device, **slowed)


class StageTiming:
    """The corrections of every device, persisted in the coordinator's state directory."""

    def __init__(self, state_dir: Path | None) -> None:
        self._path = None if state_dir is None else state_dir / FILE_NAME
        self._lock = threading.Lock()
        self._file = self._load()

    def factor(self, device: str) -> float:
        """The correction of ``device`` (1 for a device never deployed to)."""
        with self._lock:
            return correction_of(self._file.devices.get(device, DeviceTiming()))

    def factors(self) -> dict[str, float]:
        """Every known device's correction."""
        with self._lock:
            return {name: correction_of(t) for name, t in self._file.devices.items()}

    def term_factors(self, model: str = "") -> TermFactors | None:
        """The per-term factors for ``model``: fitted on its own measured stages, or on the
        latest :data:`STAGE_WINDOW` stages of any model when it has none (None before any)."""
        with self._lock:
            return _fit_for(self._file.stages, model)

    def unit_scales(self, model: str) -> list[float] | None:
        """How many times its roofline work each unit of ``model`` is priced at
        (:mod:`coordinator.deploy.unit_residuals`); None before its first measured deploy."""
        with self._lock:
            return unit_scales(self._file.residuals.get(model))

    def apply(self, devices: Sequence[LiveDevice], model: str = "") -> list[LiveDevice]:
        """``devices`` as a plan of ``model`` should see them: roofline-priced ones with the
        per-term factors (once any stage was measured), the others with their own correction."""
        factors = self.term_factors(model)
        return [
            term_corrected(d, factors)
            if factors is not None and d.memory_gbps is not None
            else corrected(d, self.factor(d.name))
            for d in devices
        ]

    def record(self, stages: Sequence[StageTime], applied: Mapping[str, float]) -> None:
        """Learn from the measured stages of a deploy planned with the ``applied`` corrections
        (a prediction made with correction ``c`` is ``c`` times the uncorrected one)."""
        with self._lock:
            devices = dict(self._file.devices)
            samples = list(self._file.stages)
            for stage in stages:
                factor = applied.get(stage.device, 1.0)
                if stage.predicted_s <= 0 or stage.measured_s < MIN_MEASURED_S:
                    continue
                ratio = stage.measured_s / (stage.predicted_s / factor)
                if stage.terms is not None and stage.terms.total_s > 0:
                    samples.append(_sample(stage, stage.terms))
                    ratio = stage.measured_s / stage.terms.total_s
                old = devices.get(stage.device, DeviceTiming()).ratios
                devices[stage.device] = DeviceTiming(ratios=[*old, ratio][-WINDOW:])
                log.info(
                    "%s: stage measured %.3f ms, predicted %.3f ms (x%.2f); correction now %.2f",
                    stage.device,
                    stage.measured_s * 1e3,
                    stage.predicted_s * 1e3,
                    stage.measured_s / stage.predicted_s,
                    correction_of(devices[stage.device]),
                )
            kept = _latest_per_model(samples)
            residuals = _residuals(self._file.residuals, stages, kept)
            self._file = TimingFile(devices=devices, stages=kept, residuals=residuals)
            self._save()

    def _load(self) -> TimingFile:
        if self._path is None or not self._path.exists():
            return TimingFile()
        try:
            return TimingFile.model_validate_json(self._path.read_bytes())
        except (OSError, ValidationError) as exc:
            log.warning("ignoring unreadable %s: %s", self._path, exc)
            return TimingFile()

    def _save(self) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._file.model_dump(), indent=2))
        tmp.replace(self._path)


def _fit_for(samples: Sequence[StageSample], model: str) -> TermFactors | None:
    """The factors fitted on ``model``'s samples, else on the latest of any model."""
    stages = [s for s in samples if s.model == model] or list(samples[-STAGE_WINDOW:])
    if not stages:
        return None
    newest = sorted({s.plan_version for s in stages}, reverse=True)
    return fit_terms(
        [TermSample(s.terms(), s.measured_s, newest.index(s.plan_version)) for s in stages]
    )


def _residuals(
    old: Mapping[str, UnitResiduals],
    stages: Sequence[StageTime],
    samples: Sequence[StageSample],
) -> dict[str, UnitResiduals]:
    """``old`` with each of ``stages`` measured against its prediction by its model's
    factors fitted on ``samples`` (which hold them)."""
    out = dict(old)
    for stage in stages:
        if stage.terms is None or stage.units is None or stage.measured_s < MIN_MEASURED_S:
            continue
        factors = _fit_for(samples, stage.model)
        if factors is None:
            continue
        parts = zip(stage.terms.parts(), dataclasses.astuple(factors), strict=True)
        predicted = math.fsum(part * factor for part, factor in parts)
        if predicted <= 0:
            continue
        current = out.get(stage.model, UnitResiduals())
        ratio = stage.measured_s / predicted
        out[stage.model] = with_stage(current, stage.unit_count, stage.units, ratio)
    return out


def _latest_per_model(samples: Sequence[StageSample]) -> list[StageSample]:
    """The latest :data:`STAGE_WINDOW` of each model's ``samples`` (oldest first), at most
    :data:`MAX_STAGES` in all."""
    kept: list[StageSample] = []
    per_model: dict[str, int] = {}
    for sample in reversed(samples):
        if per_model.get(sample.model, 0) < STAGE_WINDOW and len(kept) < MAX_STAGES:
            per_model[sample.model] = per_model.get(sample.model, 0) + 1
            kept.append(sample)
    return kept[::-1]


def _sample(stage: StageTime, terms: StageTerms) -> StageSample:
    return StageSample(
        device=stage.device,
        plan_version=stage.plan_version,
        compute_s=terms.compute_s,
        memory_s=terms.memory_s,
        fixed_s=terms.fixed_s,
        measured_s=stage.measured_s,
        gemv_s=terms.gemv_s,
        model=stage.model,
    )


def stage_times(
    version: VersionRecord,
    unit_work: Sequence[Work] = (),
    unit_ranges: Sequence[tuple[int, int]] = (),
    devices: Sequence[LiveDevice] = (),
) -> list[StageTime]:
    """Each placed segment's predicted and measured (steady-state warm-up) stage time; with
    the plan's ``unit_work``, each segment's ``unit_ranges`` and the uncorrected ``devices``,
    the prediction's two parts too (for roofline-priced devices)."""
    by_name = {d.name: d for d in devices}
    out = []
    for i, p in enumerate(version.segments):
        device = by_name.get(p.device)
        terms = None
        if device is not None and device.memory_gbps is not None and i < len(unit_ranges):
            lo, hi = unit_ranges[i]
            if hi <= len(unit_work):
                terms = stage_terms(unit_work[lo:hi], roofs_of(device), p.costs)
        out.append(
            StageTime(
                p.device,
                p.predicted_compute_s,
                p.warmup_s,
                terms,
                version.plan_version,
                version.model_id,
                unit_ranges[i] if i < len(unit_ranges) else None,
                len(unit_work),
            )
        )
    return out


def roofs_of(device: LiveDevice) -> Roofs:
    """The roofs ``device`` is priced by."""
    return Roofs(gflops=device.gflops, **roof_values(device))


def calibrates_at_deploy(model_path: Path, devices: DeviceList | None = None) -> bool:
    """Whether a deploy of ``model_path`` onto ``devices`` times its units first: only for
    devices priced by FLOPs alone (agents without a memory roof), and only small models (a
    second or two; the file and its external data up to :data:`CALIBRATE_MAX_BYTES`).

    Devices with both roofs are priced by the roofline, whose operator, call and selection
    costs already say how the time is spread over the units; unit times measured here, one
    ``session.run`` per unit, would charge every unit a call of its own (tiny-llama: 11 calls
    of 7-12 us against the 2 of its two-stage plan) and bring this machine's load into it."""
    if devices is not None and all(d.memory_gbps is not None for d in devices.devices):
        return False
    try:
        size = model_path.stat().st_size
        size += sum(p.stat().st_size for p in model_path.parent.glob(f"{model_path.name}*.data"))
        size += sum(p.stat().st_size for p in model_path.parent.glob(f"{model_path.stem}.data"))
    except OSError:
        return False
    return size <= CALIBRATE_MAX_BYTES
