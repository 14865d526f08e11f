"""What the per-term fit leaves unexplained, kept per planning unit of a model.

The per-term factors (:mod:`coordinator.deploy.term_fit`) price a model's stages by kind of
work; the fit weighs stages by their time, so a stage that is a few hundred microseconds of a
plan of 25 ms stages has no say in it, and element-wise operators of different kinds share one
roof. MiniLM's embedding stage (LayerNorm and additions, 0.19 ms) was predicted at 2.1-2.2x
by the factors its 25 ms attention stages set (softmax and GELU).

So after each deploy, every measured stage's *residual* (measured time over its prediction
with the model's newly fitted factors) is kept for each unit the stage held, the latest
:data:`RESIDUAL_WINDOW` of them a unit; later plans of the model price each unit's work that
many times (:func:`unit_scales`: the geometric mean, within [:data:`LOWEST`, :data:`HIGHEST`]).
A stage cut the same way again is then predicted at what it measured; a unit that moves to a
new stage carries its old stage's residual. Pure functions over plain data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field, PositiveFloat

from protocols.base import FrozenModel

RESIDUAL_WINDOW = 3
"""Residuals kept per unit (the latest deploys')."""
LOWEST = 0.25
HIGHEST = 4.0


class UnitResiduals(FrozenModel):
    """One model's residuals: ``ratios[u]`` are unit ``u``'s latest, oldest first."""

    ratios: list[list[PositiveFloat]] = Field(default_factory=list)


def with_stage(
    residuals: UnitResiduals, unit_count: int, units: tuple[int, int], ratio: float
) -> UnitResiduals:
    """``residuals`` of a model of ``unit_count`` units after a stage holding ``units``
    (half-open) measured ``ratio`` times its prediction; residuals of another unit count (the
    model cut into other units) are dropped."""
    ratios = residuals.ratios if len(residuals.ratios) == unit_count else [[]] * unit_count
    lo, hi = units
    return UnitResiduals(
        ratios=[
            [*kept, ratio][-RESIDUAL_WINDOW:] if lo <= u < hi else kept
            for u, kept in enumerate(ratios)
        ]
    )


def unit_scales(residuals: UnitResiduals | None) -> list[float] | None:
    """How many times its roofline work each unit is priced at (1 for a unit without
    residuals); None without any."""
    if residuals is None or not residuals.ratios:
        return None
    return [_mean(kept) for kept in residuals.ratios]


def _mean(ratios: Sequence[float]) -> float:
    if not ratios:
        return 1.0
    mean = math.exp(math.fsum(math.log(r) for r in ratios) / len(ratios))
    return min(HIGHEST, max(LOWEST, mean))
