"""Per-term corrections of the roofline, fitted on the stages the agents measured.

A stage's predicted time has four parts that go wrong for different reasons
(:func:`stage_terms`):

- the **compute** part, ``flops / compute`` of its units bound by compute and the
  element-wise FLOPs of all of them, priced by the product and element-wise roofs an agent
  measured at its start (their best runs);
- the **memory** part, ``bytes / bandwidth`` of its units bound by memory, priced by the
  streaming-read roofs measured at start; a real stage reads its weights through other
  kernels than the benchmark's;
- the **gemv** part, one-row 4-bit products (``MatMulNBits`` in a decode step) at the
  ``gemv_gflops`` roof: their own kernel, so an encoder's compute factor says nothing of them
  (MiniLM's 1.22 applied to them priced Qwen 1.5B's stages at 1.11-1.15x);
- the **fixed** part, ``ops x op_us + topk_elements x topk_ns + call_us``, priced by costs
  the agent measures again next to every warm-up (``DeployReport.costs``), since they move
  with the load by up to 2.5x in a few minutes; a real node still costs more or less than an
  operator of the benchmark's chain.

One correction per device cannot fix them all: tiny-llama's first stage is almost all fixed
cost, its last almost all bytes, and MiniLM's stages are compute. So the coordinator fits one
factor per part, shared by every device (a device's own speed is in its roofs), by least
squares on the relative errors of the recent stages (:func:`fit_terms`): ``measured ~
compute x k_compute + memory x k_memory + fixed x k_fixed + gemv x k_gemv``. A weak pull
towards 1 decides what the stages leave open (a part none of them has); newer deploys and
longer stages weigh more.

Pure functions over plain numbers; the planner sees only the devices' roofs scaled by the
factors (:func:`coordinator.deploy.stage_timing.term_corrected`), so it stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocols.deploy import FixedCosts
from protocols.problem import Roofs, Work

PULL = 0.01
"""Weight of the pull of each factor towards 1, against the mean squared share of the parts
in the stages (it decides only what the stages leave open)."""
AGE_WEIGHT = 0.5
"""A stage of the deploy before the newest weighs this much, the one before that its square."""
LOWEST = 0.05
HIGHEST = 20.0


@dataclass(frozen=True)
class StageTerms:
    """A stage's predicted time in its parts, seconds (uncorrected)."""

    compute_s: float
    memory_s: float
    fixed_s: float
    gemv_s: float = 0.0
    """One-row 4-bit products (their own kernel: a factor of their own)."""

    @property
    def total_s(self) -> float:
        """The whole prediction."""
        return self.compute_s + self.memory_s + self.fixed_s + self.gemv_s

    def parts(self) -> tuple[float, float, float, float]:
        """The parts in :class:`TermFactors`' order."""
        return (self.compute_s, self.memory_s, self.fixed_s, self.gemv_s)


@dataclass(frozen=True)
class TermSample:
    """One measured stage: its predicted parts and its measured time."""

    terms: StageTerms
    measured_s: float
    age: int = 0
    """How many deploys ago it was measured (0: the newest)."""


@dataclass(frozen=True)
class TermFactors:
    """How much slower than predicted each part runs."""

    compute: float = 1.0
    memory: float = 1.0
    fixed: float = 1.0
    gemv: float = 1.0


def stage_terms(work: Sequence[Work], roofs: Roofs, costs: FixedCosts | None) -> StageTerms:
    """The parts of a stage made of ``work``'s units under ``roofs``, the fixed one priced with
    ``costs`` (the agent's measurement of the same second) when given, else with the roofs' own
    ``op_us``, ``call_us`` and ``topk_ns``. With ``costs`` None they add up to the stage's
    roofline time (:func:`partitioner.analysis.roofline.stage_seconds`)."""
    fixed = costs or FixedCosts(op_us=roofs.op_us, call_us=roofs.call_us, topk_ns=roofs.topk_ns)
    stage_bytes = sum(w.bytes_read for w in work)
    compute = memory = gemv = 0.0
    for w in work:
        flops_s = roofs.product_s(w)
        bytes_s = roofs.memory_s(w, stage_bytes)
        if bytes_s > flops_s:
            memory += bytes_s
        else:
            compute += flops_s
        compute += roofs.vector_s(w)
        gemv += roofs.gemv_s(w)
    ops = sum(w.ops for w in work)
    selected = sum(w.topk_elements for w in work)
    fixed_s = ops * fixed.op_us / 1e6 + selected * fixed.topk_ns / 1e9 + fixed.call_us / 1e6
    return StageTerms(compute, memory, fixed_s, gemv)


def _time_weights(samples: Sequence[TermSample]) -> np.ndarray:
    """Each stage's squared measured time over the longest of its deploy's (same ``age``):
    the fit's relative errors so weighed are errors in time, in units of the deploy's longest
    stage, so the stages that make a plan's bottleneck and latency decide the factors.
    Weighed alike, MiniLM's 0.15 ms embedding stage (predicted 1.6-2.4x) outvoted its three
    21-26 ms stages and pulled the memory and fixed factors down (to their floor of 0.05, or
    to 0.49 weighed by time alone), on which Qwen 1.5B's memory-bound stages were then
    predicted at 0.48x and 0.80x."""
    longest: dict[int, float] = {}
    for s in samples:
        longest[s.age] = max(longest.get(s.age, 0.0), s.measured_s)
    return np.array([(s.measured_s / longest[s.age]) ** 2 for s in samples])


def fit_terms(samples: Sequence[TermSample]) -> TermFactors:
    """The factors minimising the squared relative error of ``samples``, each weighed by its
    age and its time (:func:`_time_weights`), plus a pull (:data:`PULL`) of each factor
    towards 1, each within [:data:`LOWEST`, :data:`HIGHEST`]
    (a factor out of range is pinned at its bound and the others fitted again)."""
    usable = [s for s in samples if s.measured_s > 0 and s.terms.total_s > 0]
    if not usable:
        return TermFactors()
    shares = np.array([s.terms.parts() for s in usable]) / np.array(
        [[s.measured_s] for s in usable]
    )
    weights = np.array([AGE_WEIGHT**s.age for s in usable]) * _time_weights(usable)
    gram = shares.T @ (shares * weights[:, None])
    right = shares.T @ weights
    parts = len(TermFactors.__dataclass_fields__)
    pull = PULL * float(np.trace(gram)) / parts  # scaled to the data: a stage 10x off is fixed
    pinned: dict[int, float] = {}
    while True:
        free = [i for i in range(parts) if i not in pinned]
        if not free:
            return TermFactors(*(pinned[i] for i in range(parts)))
        rhs = right[free] + pull
        for i, value in pinned.items():
            rhs -= gram[free, i] * value
        solved = np.linalg.solve(gram[np.ix_(free, free)] + pull * np.eye(len(free)), rhs)
        factors = dict(pinned) | {i: float(v) for i, v in zip(free, solved, strict=True)}
        outside = [i for i in free if not LOWEST <= factors[i] <= HIGHEST]
        if not outside:
            return TermFactors(*(factors[i] for i in range(parts)))
        worst = max(outside, key=lambda i: abs(factors[i] - 1.0))
        pinned[worst] = min(HIGHEST, max(LOWEST, factors[worst]))
