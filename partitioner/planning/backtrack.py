"""Recovering the optimal chain from the kept layers of :func:`partitioner.planning.engine.run`.

Each step back finds a predecessor whose value, extended by the same operations as the forward
pass, reproduces the current value exactly, so the chain recovered is one the programme valued.
"""

from __future__ import annotations

import numpy as np

from partitioner.planning.engine import Layer, Outcome, Programme
from partitioner.planning.tables import FloatArray


def backtrack(prog: Programme, outcome: Outcome) -> list[tuple[int, int, int]]:
    """The optimal chain as ``(class, start, end)`` stages, recovered from the kept layers.

    Each step finds a predecessor whose value, extended by the same operations as the forward
    pass, reproduces the current value exactly.
    """
    if outcome.location is None:
        raise ValueError("backtracking needs a run that kept its layers and found a chain")
    t, key, value = outcome.location
    state, group = divmod(key, prog.n_groups)
    position = prog.n
    stages: list[tuple[int, int, int]] = []
    while t > 0:
        cls, start, group, value = _predecessor(
            prog, outcome.layers, t, state, group, position, value
        )
        stages.append((cls, start, position))
        state -= int(prog.fleet.strides[cls])
        position, t = start, t - 1
    return stages[::-1]


def _predecessor(
    prog: Programme,
    layers: list[Layer],
    t: int,
    state: int,
    group: int,
    position: int,
    value: float,
) -> tuple[int, int, int, float]:
    fleet = prog.fleet
    for cls in fleet.groups[group]:
        if fleet.counts[state, cls] == 0:
            continue
        previous = state - int(fleet.strides[cls])
        column = prog.stage_cost[cls][:, position]
        if t == 1:
            first = prog.semiring.combine(np.array(prog.start(cls)), column[0])
            if previous == 0 and float(first) == value:
                return cls, 0, 0, prog.start(cls)
            continue
        found = _match(prog, layers[t - 2], previous, cls, column, position, value)
        if found is not None:
            return (cls, *found)
    raise RuntimeError("internal error: backtracking lost the optimal chain")


def _match(
    prog: Programme,
    layer: Layer,
    state: int,
    cls: int,
    column: FloatArray,
    position: int,
    value: float,
) -> tuple[int, int, float] | None:
    """``(start, group, value)`` of a predecessor in ``layer`` that leads to ``value``."""
    groups = prog.n_groups
    first, last = np.searchsorted(layer.keys, [state * groups, (state + 1) * groups])
    if first == last or layer.lo >= position:
        return None
    senders = layer.keys[first:last] % groups
    width = min(layer.hi, position - 1) - layer.lo + 1
    previous = layer.values[first:last, :width]
    cost = prog.transfer[senders, cls, layer.lo : layer.lo + width]
    handed = prog.semiring.combine(previous, cost)
    reached = prog.semiring.combine(handed, column[layer.lo : layer.lo + width][None, :])
    hits = np.argwhere(reached == value)
    if hits.size == 0:
        return None
    row, offset = (int(x) for x in hits[0])
    return layer.lo + offset, int(senders[row]), float(previous[row, offset])
