"""The cost model as numpy tables indexed by cut position.

A *cut position* ``c`` in ``0..n`` is the boundary before unit ``c``; a stage is a pair of cut
positions ``c < c'`` holding units ``[c, c')``. Each table entry is computed with the same
floating-point operations, in the same order, as :mod:`partitioner.planning.semantics`, so the
numbers agree exactly (``np.cumsum`` accumulates left to right like the scalar loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.errors import PlanningInputError
from protocols.problem import PlanningProblem

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

EXACT_LIMIT = 2**53
"""Byte counts must stay below this so that integer and float arithmetic on them is exact."""


@dataclass(frozen=True)
class Tables:
    """Per-stage compute and memory for every pair of cut positions."""

    n: int
    compute: dict[str, FloatArray]
    """Per device type, ``(n+1, n+1)``: seconds for units ``[c, c')`` (their seconds plus
    the type's cost of one segment run); ``inf`` unless ``c < c'``."""
    unit_compute: dict[str, FloatArray]
    """Per device type, ``(n,)``: each unit's least seconds in any stage (no run cost): for
    bounds."""
    memory: IntArray
    """``(n+1, n+1)``: stage memory in bytes for ``[c, c')``; ``EXACT_LIMIT`` unless ``c < c'``."""
    out_bytes: FloatArray
    """``(n,)``: each unit's ``out_bytes`` as float."""

    def transfer(self, bandwidth_mbps: float, latency_ms: float) -> FloatArray:
        """``(n+1,)``: seconds to send the activation at each cut over one link.

        Entry ``c`` is the transfer after a stage ending at ``c``; ``inf`` at 0 and ``n``,
        where no stage can follow.
        """
        result = np.full(self.n + 1, np.inf)
        result[1 : self.n] = self.out_bytes[:-1] * 8.0 / (bandwidth_mbps * 1e6) + latency_ms / 1e3
        return result


def build_tables(problem: PlanningProblem) -> Tables:
    """Compute the stage tables of ``problem`` (``O(n^2)`` per device type)."""
    _check_exact(problem)
    n = len(problem.units)
    types = sorted({device.type for device in problem.devices})
    roofs = problem.type_roofs()
    stage_bytes = _stage_bytes_table(problem)
    compute: dict[str, FloatArray] = {}
    units: dict[str, FloatArray] = {}
    for kind in types:
        # a unit costs one of two values: in a stage whose bytes fit the type's cache, or not
        cache_bytes = roofs[kind].cache_bytes if kind in roofs else 0
        fits = np.array([problem.unit_seconds(i, kind, 0) for i in range(n)])
        spills = np.array([problem.unit_seconds(i, kind, cache_bytes + 1) for i in range(n)])
        table = np.where(stage_bytes <= cache_bytes, _compute_table(fits), _compute_table(spills))
        compute[kind] = table + problem.call_seconds(kind)
        units[kind] = np.minimum(fits, spills)
    out = np.array([unit.out_bytes for unit in problem.units], dtype=np.float64)
    memory = _memory_table(problem)
    return Tables(n=n, compute=compute, unit_compute=units, memory=memory, out_bytes=out)


def _stage_bytes_table(problem: PlanningProblem) -> IntArray:
    """``(n+1, n+1)``: bytes units ``[c, c')`` read together (their ``work``), exact."""
    read = [0] + [u.work.bytes_read if u.work is not None else 0 for u in problem.units]
    prefix = np.cumsum(np.array(read, dtype=np.int64))
    table: IntArray = prefix[None, :] - prefix[:, None]
    return table


def _check_exact(problem: PlanningProblem) -> None:
    biggest_buffer = max([problem.input_bytes, *(unit.out_bytes for unit in problem.units)])
    bound = (
        sum(unit.weight_bytes for unit in problem.units)
        + sum(weight.bytes for weight in problem.shared_weights)
        + max(unit.workspace_bytes for unit in problem.units)
        + 2 * biggest_buffer * (1 + problem.queue_depth)
    )
    if bound >= EXACT_LIMIT:
        raise PlanningInputError(
            f"byte counts add up to {bound}, beyond the {EXACT_LIMIT} the planner handles exactly"
        )


def _upper(n: int) -> npt.NDArray[np.bool_]:
    """``(n+1, n+1)`` mask of ``c < c'``."""
    index = np.arange(n + 1)
    return index[:, None] < index[None, :]


def _compute_table(per_unit: FloatArray) -> FloatArray:
    n = per_unit.shape[0]
    index = np.arange(n)
    # Row c holds 0 before unit c, so its running sum is exactly sum(per_unit[c:j+1]).
    masked = np.where(index[None, :] >= index[:, None], per_unit[None, :], 0.0)
    running = np.cumsum(masked, axis=1)
    table = np.full((n + 1, n + 1), np.inf)
    table[:n, 1:] = running
    table[~_upper(n)] = np.inf
    return table


def _memory_table(problem: PlanningProblem) -> IntArray:
    n = len(problem.units)
    weights = np.array([unit.weight_bytes for unit in problem.units], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(weights)])
    total = prefix[None, :] - prefix[:, None]
    for shared in problem.shared_weights:
        total = total + shared.bytes * _touches(n, shared.units)
    total = total + _workspace_table(problem)
    outs = np.array([unit.out_bytes for unit in problem.units], dtype=np.int64)
    in_bytes = np.concatenate([[problem.input_bytes], outs])
    out_bytes = np.concatenate([[0], outs])
    total = total + (in_bytes[:, None] + out_bytes[None, :]) * (1 + problem.queue_depth)
    return np.where(_upper(n), total, EXACT_LIMIT).astype(np.int64)


def _touches(n: int, units: list[int]) -> IntArray:
    """``(n+1, n+1)``: 1 where stage ``[c, c')`` contains any of ``units``."""
    first_at_or_after = np.full(n + 1, n, dtype=np.int64)
    for unit in sorted(set(units), reverse=True):
        first_at_or_after[: unit + 1] = unit
    index = np.arange(n + 1)
    return (index[None, :] > first_at_or_after[:, None]).astype(np.int64)


def _workspace_table(problem: PlanningProblem) -> IntArray:
    n = len(problem.units)
    workspace = np.array([unit.workspace_bytes for unit in problem.units], dtype=np.int64)
    index = np.arange(n)
    masked = np.where(index[None, :] >= index[:, None], workspace[None, :], 0)
    running = np.maximum.accumulate(masked, axis=1)
    table = np.zeros((n + 1, n + 1), dtype=np.int64)
    table[:n, 1:] = running
    return table
