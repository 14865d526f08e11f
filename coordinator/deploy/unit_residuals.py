"""What the per-term fit leaves unexplained, kept per planning unit of a model.

The per-term factors (:mod:`coordinator.deploy.term_fit`) price a model's stages by kind of
work; the fit weighs stages by their time, so a stage that is a few hundred microseconds of a
plan of 25 ms stages has no say in it, and element-wise operators of different kinds share one
roof. MiniLM's embedding stage (LayerNorm and additions, 0.19 ms) was predicted at 2.1-2.2x
by the factors its 25 ms attention stages set (softmax and GELU).

So after each deploy, every measured stage's *residual* (measured time over its prediction
with the model's newly fitted factors) is kept with the units it held, the latest
:data:`RESIDUAL_STAGES` of a model; later plans of the model price each unit's work
:func:`unit_scales` times. The scales are the least-squares solution, in logarithms, of "a
stage's residual is the mean of its units' scales" over the kept stages (the smallest
solution where the stages leave it open, within [:data:`LOWEST`, :data:`HIGHEST`]):

- a stage cut the same way again is predicted at what it measured (the geometric mean of its
  measurements when it was measured more than once);
- a unit first measured inside a longer stage carries that stage's residual;
- once two plans cut the model differently, the parts of a stage are told apart: in the demo,
  Gemma 3 270M's units 2-28 (layers 3-17) had a residual of 1.07-1.09 together, but units
  23-28 (layers 13-17) alone 0.71-0.86 and units 0-22 1.08-1.15. The re-plan that first
  cut them there predicted units 23-28 at 1.39-1.54x of what they measured; the plan after
  it, priced on both cuts, at 0.89x and 1.03x (one residual a unit, the latest three
  averaged, would have kept about half of the error).

Pure functions over plain data.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from protocols.base import FrozenModel

RESIDUAL_STAGES = 16
"""Measured stages kept per model (about the latest four deploys')."""
LOWEST = 0.25
HIGHEST = 4.0
_PER_UNIT = TypeAdapter(list[list[PositiveFloat]])


class StageResidual(FrozenModel):
    """One measured stage: the units it held (half-open) and its measured/predicted time."""

    units: tuple[NonNegativeInt, NonNegativeInt]
    ratio: PositiveFloat


class UnitResiduals(FrozenModel):
    """One model's residuals: its latest measured stages, oldest first, for a model of
    ``unit_count`` units. Files written before the stages were kept (``ratios``: each unit's
    latest residuals) are read as one stage per run of units with the same residuals, at their
    geometric mean: the scales those files gave."""

    unit_count: NonNegativeInt = 0
    stages: list[StageResidual] = Field(default_factory=list, max_length=RESIDUAL_STAGES)

    @model_validator(mode="before")
    @classmethod
    def _from_unit_ratios(cls, data: Any) -> Any:
        if not (isinstance(data, dict) and "ratios" in data and "stages" not in data):
            return data
        try:
            per_unit = _PER_UNIT.validate_python(data["ratios"])
        except ValidationError as exc:
            raise ValueError(f"per-unit residuals: {exc}") from exc
        return {"unit_count": len(per_unit), "stages": _unit_runs(per_unit)}

    @model_validator(mode="after")
    def _units_in_range(self) -> UnitResiduals:
        for stage in self.stages:
            lo, hi = stage.units
            if not 0 <= lo < hi <= self.unit_count:
                raise ValueError(f"units {lo}-{hi} of a model of {self.unit_count} units")
        return self


def _unit_runs(per_unit: list[list[float]]) -> list[dict[str, Any]]:
    """Per-unit residual lists (the units of one stage kept the same ones) as one stage per run
    of units with the same list, at its geometric mean; where there are more runs than
    :data:`RESIDUAL_STAGES`, the ones furthest from 1."""
    runs: list[tuple[int, int, list[float]]] = []
    for unit, kept in enumerate(per_unit):
        if not kept:
            continue
        if runs and runs[-1][1] == unit and runs[-1][2] == kept:
            runs[-1] = (runs[-1][0], unit + 1, kept)
        else:
            runs.append((unit, unit + 1, kept))
    means = [((lo, hi), math.fsum(math.log(r) for r in kept) / len(kept)) for lo, hi, kept in runs]
    furthest = sorted(means, key=lambda run: abs(run[1]), reverse=True)[:RESIDUAL_STAGES]
    return [{"units": units, "ratio": math.exp(log)} for units, log in sorted(furthest)]


def with_stage(
    residuals: UnitResiduals, unit_count: int, units: tuple[int, int], ratio: float
) -> UnitResiduals:
    """``residuals`` of a model of ``unit_count`` units after a stage holding ``units``
    (half-open) measured ``ratio`` times its prediction; residuals of another unit count (the
    model cut into other units) are dropped."""
    kept = residuals.stages if residuals.unit_count == unit_count else []
    stage = StageResidual(units=units, ratio=ratio)
    return UnitResiduals(unit_count=unit_count, stages=[*kept, stage][-RESIDUAL_STAGES:])


def unit_scales(residuals: UnitResiduals | None) -> list[float] | None:
    """How many times its roofline work each unit is priced at (1 for a unit no kept stage
    held); None without any kept stage."""
    if residuals is None or not residuals.stages:
        return None
    count = residuals.unit_count
    means = np.zeros((len(residuals.stages), count))
    logs = np.zeros(len(residuals.stages))
    for row, stage in enumerate(residuals.stages):
        lo, hi = stage.units
        means[row, lo:hi] = 1.0 / (hi - lo)
        logs[row] = math.log(stage.ratio)
    solution = np.linalg.lstsq(means, logs, rcond=None)[0]
    return [min(HIGHEST, max(LOWEST, math.exp(float(x)))) for x in solution]
