"""The planner: which devices, in which order, cut where, so that the objective is optimal.

Pure functions: a :class:`~protocols.problem.PlanningProblem` in, a :class:`~protocols.plan.Plan`
out. The optimum is exact over device selection, device order and cut points, under the
semantics of :mod:`protocols.problem` (implemented literally in :func:`evaluate`).

How (see :mod:`partitioner.planning.engine` for the dynamic programme itself):

- **throughput**: ``max over stages of max(compute, transfer) <= B`` holds iff every compute and
  every transfer is ``<= B``, so the bottleneck is a min-max over independent terms and a min-max
  dynamic programme finds the least bottleneck ``B*`` exactly. With many states (devices that
  are all distinct) a search is faster: ``B*`` is one of the finite stage computes and
  hand-overs, and a bit-set feasibility check (:mod:`partitioner.planning.reach`) tells whether
  a candidate bound can be met, so a galloping search and a bisection over the sorted candidates
  find it. A second, min-plus pass over the stages and hand-overs that cost at most ``B*`` then
  picks, among the chains with that bottleneck, the one with the least latency (then the fewest
  devices).
- **latency**: one min-plus pass (ties: fewest devices).
- **requester**: when the problem has one, the in-transfer of the first stage's class starts
  each chain and the out-transfer of the last stage's sender group ends it, in both passes and
  in the search (they are candidates for ``B*`` like any other cost).
- **infeasible**: a min-max pass over each stage's memory overflow gives the least, over all
  arrangements, of the largest overflow: the shortfall reported by
  :class:`~partitioner.errors.InfeasiblePlanError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.errors import InfeasiblePlanError, PlanningInputError
from partitioner.planning import reach
from partitioner.planning.backtrack import backtrack
from partitioner.planning.engine import Bounds, Programme, Semiring, run
from partitioner.planning.fleet import Fleet, build_fleet
from partitioner.planning.reach import Costs
from partitioner.planning.semantics import (
    Arrangement,
    evaluate,
    format_bytes,
    memory_overflows,
    transfer_seconds,
)
from partitioner.planning.tables import (
    EXACT_LIMIT,
    FloatArray,
    Tables,
    build_tables,
)
from protocols.plan import Objective, Plan
from protocols.problem import PlanningProblem

__all__ = [
    "Arrangement",
    "PlanningInputError",
    "evaluate",
    "memory_overflows",
    "plan",
    "shortfall_bytes",
]

SEARCH_ABOVE = 1 << 14
"""States times sender groups above which ``B*`` is searched for rather than computed by the
min-max pass (the pass is faster on a few classes, the search on many)."""


@dataclass(frozen=True)
class _Setup:
    problem: PlanningProblem
    tables: Tables
    fleet: Fleet
    compute: list[FloatArray]
    """Per class: stage compute where the stage fits the class's memory, else ``inf``."""
    transfer: FloatArray
    rest: FloatArray
    capacity: FloatArray
    inbound: FloatArray | None
    """``(K,)``: the requester's in-transfer to each class; ``None`` without a requester."""
    outbound: FloatArray | None
    """``(G,)``: the out-transfer from each sender group to the requester."""


def plan(problem: PlanningProblem, objective: Objective = Objective.THROUGHPUT) -> Plan:
    """The optimal plan for ``problem`` under ``objective``.

    Throughput minimises the bottleneck, breaking ties by latency and then by fewer devices;
    latency minimises end-to-end time, breaking ties by fewer devices. The returned plan's
    numbers are exactly what :func:`evaluate` gives for its stages.

    Raises :class:`~partitioner.errors.InfeasiblePlanError` (with ``shortfall_bytes``) when no
    arrangement fits every stage into its device, and
    :class:`~partitioner.planning.tables.PlanningInputError` when the problem is too large to
    plan exactly (byte counts near 2^53, or more than 2^17 count-vector states, such as 18
    devices that are all distinct).
    """
    setup = _prepare(problem)
    cap = np.inf
    if objective is Objective.THROUGHPUT:
        cap = least_bottleneck(setup, search=_searched(setup))
        if not np.isfinite(cap):
            raise _infeasible(setup)
    programme = _programme(setup, Semiring.MIN_PLUS, cap)
    outcome = run(programme, keep=True)
    if not np.isfinite(outcome.best):
        raise _infeasible(setup)
    chain = backtrack(programme, outcome)
    return evaluate(problem, objective, _assign_devices(setup, chain))


ONE_DEVICE_MARGIN = 0.05
"""A sharded plan is deployed over the best one-device plan only when it is better by more than
this share of the objective."""


@dataclass(frozen=True)
class MarginChoice:
    """What :func:`choose_with_margin` chose, next to the optimum it was weighed against."""

    chosen: Plan
    optimum: Plan
    """:func:`plan`'s optimum of the stated problem."""

    @property
    def margin_applied(self) -> bool:
        """Whether a one-device plan within :data:`ONE_DEVICE_MARGIN` replaced the optimum."""
        return self.chosen is not self.optimum


def choose_with_margin(
    problem: PlanningProblem, objective: Objective = Objective.THROUGHPUT
) -> MarginChoice:
    """:func:`plan_preferring_one_device`'s choice together with the optimum it weighed."""
    best = plan(problem, objective)
    if len(best.stages) == 1:
        return MarginChoice(best, best)
    n = len(problem.units)
    alone = [evaluate(problem, objective, [(d.name, 0, n)]) for d in problem.devices]
    fitting = [p for p in alone if not memory_overflows(problem, p)]
    if not fitting:
        return MarginChoice(best, best)
    single = min(fitting, key=lambda p: (_score(p), p.latency_s, p.bottleneck_s))
    within = _score(single) <= (1 + ONE_DEVICE_MARGIN) * _score(best)
    return MarginChoice(single if within else best, best)


def plan_preferring_one_device(
    problem: PlanningProblem, objective: Objective = Objective.THROUGHPUT
) -> Plan:
    """:func:`plan`'s optimum, unless a device that holds the whole model alone comes within
    :data:`ONE_DEVICE_MARGIN` of it: then the best such one-device plan.

    Every hop costs what the problem does not price (the frame's encoding, TLS on both ends,
    one more process's scheduling): in the LAN lab MiniLM planned h3 -> h1 at 6.0 requests/s,
    h3 alone at 5.9, measured 5.6 against 6.0 (0.93x). Within the margin the plans are alike
    on paper, and the one device is the plan that is never slower than itself."""
    return choose_with_margin(problem, objective).chosen


def _score(plan: Plan) -> float:
    latency = plan.objective is Objective.LATENCY
    return plan.latency_s if latency else plan.bottleneck_s


def least_bottleneck(setup: _Setup, search: bool) -> float:
    """The least bottleneck ``B*`` (``inf`` if nothing fits): by a min-max pass of the dynamic
    programme, or by a search over the candidate values with a bit-set feasibility check
    (:mod:`partitioner.planning.reach`); both are exact and give the same value."""
    if search:
        costs = Costs(
            fleet=setup.fleet,
            compute=setup.compute,
            transfer=setup.transfer,
            rest=setup.rest,
            capacity=setup.capacity,
            inbound=setup.inbound,
            outbound=setup.outbound,
        )
        return reach.least_bottleneck(costs)
    return run(_programme(setup, Semiring.MIN_MAX, np.inf), keep=False).best


def _searched(setup: _Setup) -> bool:
    """Search for ``B*`` when the min-max pass would hold many rows per layer."""
    return setup.fleet.n_states * len(setup.fleet.groups) > SEARCH_ABOVE


def shortfall_bytes(problem: PlanningProblem) -> int:
    """The least, over all arrangements, of the largest amount by which a stage exceeds its
    device's memory. Zero or negative when some arrangement fits (then it is minus the headroom
    of the tightest stage in the roomiest arrangement)."""
    return _shortfall(_prepare(problem))


def _prepare(problem: PlanningProblem) -> _Setup:
    tables = build_tables(problem)
    fleet = build_fleet(problem)
    compute = []
    for cls in fleet.classes:
        fits = tables.memory <= min(cls.memory_bytes, EXACT_LIMIT - 1)
        compute.append(np.where(fits, tables.compute[cls.type], np.inf))
    inbound, outbound = _requester_transfers(problem, fleet)
    return _Setup(
        problem=problem,
        tables=tables,
        fleet=fleet,
        compute=compute,
        transfer=_transfer_tensor(tables, fleet),
        rest=_rest(tables, fleet),
        capacity=_capacity(tables, fleet),
        inbound=inbound,
        outbound=outbound,
    )


def _transfer_tensor(tables: Tables, fleet: Fleet) -> FloatArray:
    """``(G, K, n+1)``: hand-over seconds from each sender group to each class at each cut."""
    result = np.full((len(fleet.groups), len(fleet.classes), tables.n + 1), np.inf)
    for group in range(len(fleet.groups)):
        for cls in range(len(fleet.classes)):
            link = fleet.group_link(group, cls)
            if link is not None:
                result[group, cls] = tables.transfer(*link)
    return result


def _requester_transfers(
    problem: PlanningProblem, fleet: Fleet
) -> tuple[FloatArray | None, FloatArray | None]:
    """``(K,)`` in-transfers of ``input_bytes`` to each class and ``(G,)`` out-transfers of the
    last unit's ``out_bytes`` from each sender group, computed as the semantics compute them;
    ``(None, None)`` without a requester."""
    if fleet.requester is None:
        return None, None
    links = fleet.requester
    inbound = np.array([transfer_seconds(problem.input_bytes, *link) for link in links])
    result = problem.units[-1].out_bytes
    outbound = np.array([transfer_seconds(result, *links[group[0]]) for group in fleet.groups])
    return inbound, outbound


def _least_compute(tables: Tables, fleet: Fleet) -> FloatArray:
    """``(n,)``: each unit's least compute over the fleet's device types."""
    types = sorted({cls.type for cls in fleet.classes})
    per_type = np.array([tables.unit_compute[kind] for kind in types])
    least: FloatArray = per_type.min(axis=0)
    return least


def _rest(tables: Tables, fleet: Fleet) -> FloatArray:
    """``(n+1,)``: summed least compute of units ``[c, n)``."""
    least = _least_compute(tables, fleet)
    return np.concatenate([np.cumsum(least[::-1])[::-1], [0.0]])


def _capacity(tables: Tables, fleet: Fleet) -> FloatArray:
    """``(n_states,)``: summed speed ratio of the devices each state leaves free.

    A type's ratio ``rho`` is the largest ``least / compute`` over the units, so every unit's
    compute on that type is at least its least compute divided by ``rho``: a stage that takes at
    most ``B`` seconds there covers at most ``rho * B`` of least compute.
    """
    least = _least_compute(tables, fleet)
    rho = []
    for cls in fleet.classes:
        compute = tables.unit_compute[cls.type]
        ratios = least[compute > 0] / compute[compute > 0]
        rho.append(min(1.0, float(ratios.max())) if ratios.size else 1.0)
    free = fleet.sizes[None, :] - fleet.counts
    capacity: FloatArray = free @ np.array(rho)
    return capacity


def _programme(setup: _Setup, semiring: Semiring, cap: float) -> Programme:
    """Stages, hand-overs and transfers to or from the requester costing more than ``cap`` are
    not allowed."""
    return Programme(
        semiring=semiring,
        fleet=setup.fleet,
        stage_cost=[np.where(table <= cap, table, np.inf) for table in setup.compute],
        transfer=_capped(setup.transfer, cap),
        bounds=Bounds(rest=setup.rest, capacity=setup.capacity, ceiling=cap),
        inbound=None if setup.inbound is None else _capped(setup.inbound, cap),
        outbound=None if setup.outbound is None else _capped(setup.outbound, cap),
    )


def _capped(costs: FloatArray, cap: float) -> FloatArray:
    capped: FloatArray = np.where(costs <= cap, costs, np.inf)
    return capped


def _shortfall(setup: _Setup) -> int:
    overflow = []
    finite = setup.tables.memory < EXACT_LIMIT
    for cls in setup.fleet.classes:
        over = setup.tables.memory - min(cls.memory_bytes, EXACT_LIMIT)
        overflow.append(np.where(finite, over.astype(np.float64), np.inf))
    hand_over = np.where(np.isfinite(setup.transfer), -np.inf, np.inf)
    programme = Programme(
        semiring=Semiring.MIN_MAX, fleet=setup.fleet, stage_cost=overflow, transfer=hand_over
    )
    return int(run(programme, keep=False).best)


def _infeasible(setup: _Setup) -> InfeasiblePlanError:
    shortfall = _shortfall(setup)
    problem = setup.problem
    what = repr(problem.name) if problem.name else "the model"
    count = len(problem.devices)
    return InfeasiblePlanError(
        f"no arrangement of the {count} device{'s' if count != 1 else ''} holds {what}: "
        f"even the best one overflows a device by {shortfall} bytes ({format_bytes(shortfall)}); "
        "add memory or devices, or cut the model into smaller units",
        shortfall,
    )


def _assign_devices(setup: _Setup, chain: list[tuple[int, int, int]]) -> Arrangement:
    """Give each class's stages to its devices in problem order."""
    used = [0] * len(setup.fleet.classes)
    arrangement = []
    for cls, start, end in chain:
        index = setup.fleet.classes[cls].devices[used[cls]]
        used[cls] += 1
        arrangement.append((setup.problem.devices[index].name, start, end))
    return arrangement
