"""Per-term corrections of the roofline, fitted on the stages the agents measured.

A stage's predicted time has two parts that go wrong for different reasons
(:func:`stage_terms`):

- the **streamed** part, ``max(flops / compute, bytes / bandwidth)`` summed over its units, is
  priced by the roofs an agent measured at its start (a ``MatMul`` and a ``ReduceSum``); a
  real stage reads its weights through other kernels (a decode step's output head is a
  matrix-vector product: about 1.3x the time the ``ReduceSum``'s cache speed says, here);
- the **fixed** part, ``ops x op_us + topk_elements x topk_ns + call_us``, is priced by
  costs the agent measures again next to every warm-up (``DeployReport.costs``), since they
  move with the load by up to 2.5x in a few minutes; a real node still costs more or less
  than an operator of the benchmark's chain.

One correction per device cannot fix both: tiny-llama's first stage is almost all fixed cost,
its last almost all streamed. So the coordinator fits one factor per part, shared by every
device (a device's own speed is in its roofs), by least squares on the relative errors of the
recent stages (:func:`fit_terms`): ``measured ~ streamed x k_streamed + fixed x k_fixed``.
A weak pull towards 1 keeps the fit defined on one stage; newer deploys weigh more.

Pure functions over plain numbers; the planner sees only the devices' roofs scaled by the
factors (:func:`coordinator.deploy.stage_timing.corrected`), so it stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocols.deploy import FixedCosts
from protocols.problem import Roofs, Work, roofline_s

PULL = 0.01
"""Weight of the pull of each factor towards 1 (against 1 per stage fully weighted)."""
AGE_WEIGHT = 0.5
"""A stage of the deploy before the newest weighs this much, the one before that its square."""
LOWEST = 0.05
HIGHEST = 20.0


@dataclass(frozen=True)
class TermSample:
    """One measured stage: its two predicted parts (uncorrected) and its measured time."""

    streamed_s: float
    fixed_s: float
    measured_s: float
    age: int = 0
    """How many deploys ago it was measured (0: the newest)."""


@dataclass(frozen=True)
class TermFactors:
    """How much slower than predicted each part runs."""

    streamed: float = 1.0
    fixed: float = 1.0


def stage_terms(
    work: Sequence[Work], roofs: Roofs, costs: FixedCosts | None
) -> tuple[float, float]:
    """``(streamed_s, fixed_s)`` of a stage made of ``work``'s units under ``roofs``, the fixed
    part priced with ``costs`` (the agent's measurement of the same second) when given, else
    with the roofs' own ``op_us``, ``call_us`` and ``topk_ns``. Their sum is the stage's
    roofline time (:func:`partitioner.roofline.stage_seconds`) when ``costs`` is None."""
    fixed = costs or FixedCosts(op_us=roofs.op_us, call_us=roofs.call_us, topk_ns=roofs.topk_ns)
    bare = roofs.model_copy(update={"op_us": 0.0, "call_us": 0.0, "topk_ns": 0.0})
    streamed = sum(roofline_s(w, bare) for w in work)
    ops = sum(w.ops for w in work)
    selected = sum(w.topk_elements for w in work)
    fixed_s = ops * fixed.op_us / 1e6 + selected * fixed.topk_ns / 1e9 + fixed.call_us / 1e6
    return streamed, fixed_s


def fit_terms(samples: Sequence[TermSample]) -> TermFactors:
    """The factors minimising the weighted squared relative error of ``samples`` plus
    :data:`PULL` times each factor's squared distance from 1, each within
    [:data:`LOWEST`, :data:`HIGHEST`]."""
    usable = [s for s in samples if s.measured_s > 0 and s.streamed_s + s.fixed_s > 0]
    if not usable:
        return TermFactors()
    sxx = sxy = syy = sx = sy = 0.0
    for s in usable:
        w = AGE_WEIGHT**s.age
        x, y = s.streamed_s / s.measured_s, s.fixed_s / s.measured_s
        sxx, sxy, syy = sxx + w * x * x, sxy + w * x * y, syy + w * y * y
        sx, sy = sx + w * x, sy + w * y
    a11, a22, b1, b2 = sxx + PULL, syy + PULL, sx + PULL, sy + PULL
    det = a11 * a22 - sxy * sxy
    streamed, fixed = (b1 * a22 - sxy * b2) / det, (a11 * b2 - sxy * b1) / det
    if not _inside(streamed):  # pin it at its bound, and fit the other alone
        streamed = _clamp(streamed)
        fixed = (b2 - sxy * streamed) / a22
    elif not _inside(fixed):
        fixed = _clamp(fixed)
        streamed = _clamp((b1 - sxy * fixed) / a11)
    return TermFactors(streamed=_clamp(streamed), fixed=_clamp(fixed))


def _inside(value: float) -> bool:
    return LOWEST <= value <= HIGHEST


def _clamp(value: float) -> float:
    return min(HIGHEST, max(LOWEST, value))
