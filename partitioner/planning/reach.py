"""Bottleneck feasibility with bit sets: which chains keep every stage and hand-over within ``B``.

For a bound ``B`` the question "can units ``[0, n)`` be covered with every stage's compute and
every hand-over at most ``B``, each stage within its device's memory?" needs no values, only
reachability. ``forward[c, g]`` is the set of count vectors ``s`` (one bit per state, packed into
``uint64`` words) such that some chain places units ``[0, c)`` on exactly the devices ``s``
counts, its last stage on a class of sender group ``g``, all within ``B``. Adding a device of
class ``e`` moves state ``s`` to ``s + stride[e]``: a shift of the whole bit set, so one numpy
operation advances every state at once, and the programme loops only over cut positions and
classes.

With a requester, a chain may start on class ``e`` only if the in-transfer to it is within ``B``,
and a complete chain counts only if the out-transfer from its sender group is.

Entries that cannot finish within ``B`` even fractionally (``rest[c] > B * capacity[s]``, the
bound of :mod:`partitioner.planning.engine`) are dropped. :func:`least_bottleneck` searches the
sorted candidate values with this check; the planner uses it when there are many states (devices
that are all distinct), where the min-max pass of the dynamic programme is slow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.planning.engine import SAFETY
from partitioner.planning.fleet import Fleet
from partitioner.planning.tables import FloatArray

Words = npt.NDArray[np.uint64]
"""Bit sets over states, packed little-endian into ``uint64`` words along the last axis."""


@dataclass(frozen=True)
class Costs:
    """What the feasibility check needs: the fleet and the uncapped cost tables."""

    fleet: Fleet
    compute: list[FloatArray]
    """Per class, ``(n+1, n+1)``: stage compute, ``inf`` where the stage does not fit."""
    transfer: FloatArray
    """``(G, K, n+1)``: hand-over seconds from each sender group to each class at each cut."""
    rest: FloatArray
    """``(n+1,)``: summed least compute of units ``[c, n)``."""
    capacity: FloatArray
    """``(n_states,)``: summed speed ratio of the devices each state leaves free."""
    inbound: FloatArray | None = None
    """``(K,)``: the requester's in-transfer to each class; ``None``: no requester."""
    outbound: FloatArray | None = None
    """``(G,)``: the out-transfer from each sender group to the requester."""

    @property
    def n(self) -> int:
        """Number of units."""
        return int(self.transfer.shape[2]) - 1


def pack(bits: npt.NDArray[np.bool_]) -> Words:
    """Pack a boolean array along its last axis into ``uint64`` words (bit ``i`` = entry ``i``)."""
    size = bits.shape[-1]
    words = max(1, -(-size // 64))
    padded = np.zeros((*bits.shape[:-1], words * 64), dtype=np.bool_)
    padded[..., :size] = bits
    packed = np.packbits(padded, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u8").astype(np.uint64)


def shift_up(sets: Words, by: int) -> Words:
    """Move bit ``i`` to bit ``i + by`` (bits past the last word are dropped)."""
    words = sets.shape[-1]
    whole, part = divmod(by, 64)
    out = np.zeros_like(sets)
    if whole < words:
        out[..., whole:] = sets[..., : words - whole] << np.uint64(part)
        if part and whole + 1 < words:
            out[..., whole + 1 :] |= sets[..., : words - whole - 1] >> np.uint64(64 - part)
    return out


@dataclass(frozen=True)
class _Limits:
    ends: list[list[slice | npt.NDArray[np.intp] | None]]
    """Per class and start cut: the end cuts of the stages allowed within the bound (a slice
    when they are contiguous, as they usually are; ``None`` when there are none)."""
    senders: npt.NDArray[np.bool_]
    """``(K, n+1, G)``: hand-overs to each class at each cut allowed within the bound."""
    any_sender: npt.NDArray[np.bool_]
    """``(K, n+1)``: whether any hand-over to each class at each cut is allowed."""
    free: Words
    """``(K, words)``: states with a free device of each class."""


def _limits(costs: Costs, bound: float) -> _Limits:
    fleet, n = costs.fleet, costs.n
    ends: list[list[slice | npt.NDArray[np.intp] | None]] = []
    for table in costs.compute:
        allowed = table <= bound
        count = allowed.sum(axis=1)
        first = np.argmax(allowed, axis=1)
        last = n - np.argmax(allowed[:, ::-1], axis=1)
        rows: list[slice | npt.NDArray[np.intp] | None] = []
        for cut in range(n + 1):
            if count[cut] == 0:
                rows.append(None)
            elif count[cut] == last[cut] - first[cut] + 1:
                rows.append(slice(int(first[cut]), int(last[cut]) + 1))
            else:
                rows.append(np.flatnonzero(allowed[cut]))
        ends.append(rows)
    senders = np.transpose(costs.transfer <= bound, (1, 2, 0))
    free = pack((fleet.counts < fleet.sizes[None, :]).T)
    any_sender: npt.NDArray[np.bool_] = np.any(senders, axis=2)
    return _Limits(ends=ends, senders=senders, any_sender=any_sender, free=free)


def forward(costs: Costs, bound: float) -> Words:
    """``(n+1, G, words)``: the reachable states at each cut and sender group within ``bound``.

    Position ``n`` holds the complete chains (whose out-transfer is within ``bound`` too); the
    bound is feasible iff it is not empty.
    """
    fleet, n = costs.fleet, costs.n
    limits = _limits(costs, bound)
    groups = int(costs.transfer.shape[0])
    words = int(limits.free.shape[1])
    reach = np.zeros((n + 1, groups, words), dtype=np.uint64)
    start = np.zeros(words, dtype=np.uint64)
    start[0] = 1
    # The least cut each state may hold: the free devices must still be able to finish.
    need = costs.rest * SAFETY
    least = np.searchsorted(-need, -bound * costs.capacity, side="left")
    hopeful = pack(least[None, :] <= np.arange(n + 1)[:, None])
    for cls in range(len(fleet.classes)):
        ends = limits.ends[cls][0]
        if costs.inbound is not None and costs.inbound[cls] > bound:
            continue
        if ends is not None:
            reach[ends, fleet.group_of[cls]] |= shift_up(start, int(fleet.strides[cls]))
    for cut in range(1, n):
        here = reach[cut]
        here &= hopeful[cut][None, :]
        if not here.any():
            continue
        for cls in range(len(fleet.classes)):
            ends = limits.ends[cls][cut]
            if ends is None or not limits.any_sender[cls, cut]:
                continue
            senders = limits.senders[cls, cut]
            ready = here[0] if groups == 1 else np.bitwise_or.reduce(here[senders], axis=0)
            ready = ready & limits.free[cls]
            if ready.any():
                reach[ends, fleet.group_of[cls]] |= shift_up(ready, int(fleet.strides[cls]))
    if costs.outbound is not None:
        reach[n, costs.outbound > bound] = 0
    return reach


def feasible(costs: Costs, bound: float) -> bool:
    """Whether some chain keeps every stage and hand-over within ``bound``."""
    return bool(forward(costs, bound)[costs.n].any())


def least_bottleneck(costs: Costs) -> float:
    """The least bottleneck over all chains (``inf`` if none fits).

    The optimum is one of the finite stage computes, hand-overs and transfers to and from the
    requester. Starting from the least candidate the capacity bound allows, a galloping search
    (steps 1, 2, 4, ... candidates up) brackets it, then a bisection pins it down. The optimum
    usually lies close to that bound, so this takes about ``2 log2(d)`` checks for an optimum
    ``d`` candidates above it.
    """
    values = [table[np.isfinite(table)] for table in costs.compute]
    values.append(costs.transfer[np.isfinite(costs.transfer)].ravel())
    for requester in (costs.inbound, costs.outbound):
        if requester is not None:
            values.append(requester[np.isfinite(requester)])
    candidates = np.unique(np.concatenate(values))
    floor = costs.rest[0] * SAFETY / costs.capacity[0] if costs.capacity[0] > 0 else 0.0
    low = int(np.searchsorted(candidates, floor, side="left"))
    last = candidates.size - 1
    if low > last:
        return float(np.inf)
    # Invariant: everything below candidates[low] is infeasible.
    step = 1
    while True:
        probe = min(low + step - 1, last)
        if feasible(costs, float(candidates[probe])):
            high = probe
            break
        if probe == last:
            return float(np.inf)
        low, step = probe + 1, step * 2
    while low < high:
        middle = (low + high) // 2
        if feasible(costs, float(candidates[middle])):
            high = middle
        else:
            low = middle + 1
    return float(candidates[high])
