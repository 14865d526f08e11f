"""The layered dynamic programme over count vectors, cut positions and sender groups.

Layer ``t`` holds, for every count vector ``s`` with ``t`` devices in use, every sender group ``g``
of the last stage and every cut position ``c``, the best value of a chain that places units
``[0, c)`` on exactly those devices, its last stage ending at ``c`` (its outgoing transfer not yet
paid). Only ``(s, g)`` rows with a finite value are stored, keyed ``s * G + g``. Going from
layer ``t`` to ``t + 1`` picks a class ``e`` with a free device and a next cut ``c' > c``::

    W_e[s, c]        = min_g  combine(V[s, g, c], transfer[g, e, c])
    V'[s + e, e, c'] = min_c  combine(W_e[s, c], stage_cost[e][c, c'])

where ``combine`` is ``max`` (bottleneck) or ``+`` (latency). Both are monotone, so the minimum
over paths is exact, and the min-plus values equal the chain-order sums of
:mod:`partitioner.planning.semantics` bit for bit.

With a requester, a first stage on class ``e`` starts from the in-transfer ``inbound[e]`` instead
of the semiring's identity, and a complete chain (at cut ``n``) is worth
``combine(V[s, g, n], outbound[g])``, its out-transfer back to the requester added last, as the
semantics add it; the layers keep the values before that out-transfer.

Nothing assumes memory is monotone in the stage length: ``stage_cost`` is an arbitrary table,
``inf`` where a stage is not allowed.

Costs per transition are vectorised across states and positions, looping only over the stage
length ``c' - c`` (the band of finite ``stage_cost`` diagonals). Rows are sparse, so a large
layer is processed in blocks of states with nearby finite cuts, each over its own narrow window.
Values that cannot beat the best complete chain found so far, given a lower bound on the rest of
the chain, are pruned:

- latency: the rest costs at least ``rest[c]``, the summed least compute of units ``[c, n)``;
- bottleneck: each remaining device ``d`` can absorb at most ``rho[d] * B`` of that least compute
  within a bottleneck ``B`` (``rho`` is a per-type speed ratio, see the planner), so
  ``B >= rest[c] / capacity[s]`` where ``capacity[s]`` sums ``rho`` over the devices ``s`` leaves
  free. For a latency pass that must keep the bottleneck at most ``ceiling`` this also prunes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import numpy.typing as npt

from partitioner.planning.fleet import Fleet
from partitioner.planning.tables import FloatArray, IntArray

SAFETY = 1.0 - 1e-9
"""Lower bounds are shrunk by this factor so that rounding never prunes an optimal chain."""

BLOCK = 1024
"""States per block when a layer is advanced block by block (see :func:`_blocks`)."""


class Semiring(Enum):
    """How a chain's costs combine into its value."""

    MIN_MAX = "min-max"
    """Value = the largest cost along the chain (the bottleneck)."""
    MIN_PLUS = "min-plus"
    """Value = the sum of the costs in chain order (the latency)."""

    @property
    def identity(self) -> float:
        """Value of the empty chain."""
        return -np.inf if self is Semiring.MIN_MAX else 0.0

    def combine(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """Extend values ``a`` by costs ``b`` (broadcasting)."""
        if self is Semiring.MIN_MAX:
            return np.maximum(a, b)
        return a + b


@dataclass(frozen=True)
class Bounds:
    """Lower-bound data for pruning: optional, exactness does not depend on them."""

    rest: FloatArray
    """``(n+1,)``: summed least compute (over the fleet's types) of units ``[c, n)``."""
    capacity: FloatArray
    """``(n_states,)``: summed speed ratio ``rho`` of the devices each state leaves free."""
    ceiling: float = np.inf
    """Largest bottleneck any chain may have (a latency pass constrained by ``B*``)."""


@dataclass(frozen=True)
class Programme:
    """One dynamic programme: what a stage and a hand-over cost, and how costs combine."""

    semiring: Semiring
    fleet: Fleet
    stage_cost: list[FloatArray]
    """Per class, ``(n+1, n+1)``: cost of stage ``[c, c')``; ``inf`` where not allowed."""
    transfer: FloatArray
    """``(G, K, n+1)``: cost of handing over at cut ``c`` from group ``g`` to class ``e``."""
    bounds: Bounds | None = None
    inbound: FloatArray | None = None
    """``(K,)``: cost of the requester's in-transfer to each class; ``None``: no requester."""
    outbound: FloatArray | None = None
    """``(G,)``: cost of the out-transfer from each sender group to the requester."""
    diagonals: list[list[FloatArray]] = field(init=False)
    shortest: list[FloatArray] = field(init=False)
    """Per class, ``(n+1,)``: the least stage cost of each length (``inf`` at length 0)."""

    def __post_init__(self) -> None:
        diagonals = []
        shortest = []
        for table in self.stage_cost:
            diags = [
                np.ascontiguousarray(np.diagonal(table, offset)) for offset in range(self.n + 1)
            ]
            least = np.array([np.inf] + [float(d.min()) for d in diags[1:]])
            diagonals.append(diags)
            shortest.append(least)
        object.__setattr__(self, "diagonals", diagonals)
        object.__setattr__(self, "shortest", shortest)

    @property
    def n(self) -> int:
        """Number of units."""
        return int(self.transfer.shape[2]) - 1

    def start(self, cls: int) -> float:
        """Value of a chain before its first stage, on class ``cls``: the in-transfer."""
        if self.inbound is None:
            return self.semiring.identity
        return float(self.inbound[cls])

    def finish(self, values: FloatArray, keys: IntArray) -> FloatArray:
        """Values of complete chains (rows ``keys``) with their out-transfer added."""
        if self.outbound is None:
            return values
        return self.semiring.combine(values, self.outbound[keys % self.n_groups])

    @property
    def n_groups(self) -> int:
        """Number of sender groups."""
        return int(self.transfer.shape[0])


@dataclass(frozen=True)
class Layer:
    """Values of all chains using ``t`` devices: ``values[row, c - lo]``, row key ``s * G + g``."""

    keys: IntArray
    lo: int
    values: FloatArray

    @property
    def hi(self) -> int:
        """Last cut position held."""
        return self.lo + int(self.values.shape[1]) - 1


@dataclass(frozen=True)
class Outcome:
    """The optimum and, if layers were kept, where to start backtracking."""

    best: float
    layers: list[Layer]
    location: tuple[int, int, float] | None
    """``(t, key, value)`` of the first optimal complete chain, if layers were kept; ``value``
    is its layer value, before the out-transfer."""


@dataclass(frozen=True)
class _Contribution:
    cls: int
    states: IntArray
    lo: int
    values: FloatArray


def run(prog: Programme, keep: bool) -> Outcome:
    """Run the programme; ``best`` is ``inf`` when no chain is allowed at all."""
    total = int(prog.fleet.sizes.sum())
    best = np.inf
    best_t = 0
    layers: list[Layer] = []
    current: Layer | None = None
    for t in range(1, min(total, prog.n) + 1):
        parts = _first(prog) if current is None else _advance(prog, current, best)
        if not parts:
            break
        layer = _assemble(prog, parts)
        found = _best_final(prog, layer)
        if found < best:
            best, best_t = found, t
        pruned = _prune(prog, layer, total - t, best)
        if pruned is None:
            break
        if keep:
            layers.append(pruned)
        current = pruned
    location = _locate(prog, layers[best_t - 1], best_t) if keep and best_t else None
    return Outcome(best=float(best), layers=layers, location=location)


def _first(prog: Programme) -> list[_Contribution]:
    parts = []
    for cls in range(len(prog.stage_cost)):
        start = np.full((1, 1), prog.start(cls))
        if start[0, 0] == np.inf:
            continue
        band = _band(prog, cls, start, 0, np.inf)
        if band is not None:
            parts.append(_Contribution(cls, prog.fleet.strides[cls : cls + 1], band[0], band[1]))
    return parts


def _advance(prog: Programme, layer: Layer, best: float) -> list[_Contribution]:
    parts = []
    for block in _blocks(prog, layer):
        for cls in range(len(prog.fleet.classes)):
            ready = _hand_over(prog, block, cls)
            if ready is None:
                continue
            states, lo, values = ready
            band = _band(prog, cls, values, lo, best)
            if band is not None:
                targets = states + prog.fleet.strides[cls]
                parts.append(_Contribution(cls, targets, band[0], band[1]))
    return parts


def _blocks(prog: Programme, layer: Layer) -> list[Layer]:
    """``layer`` cut into blocks of about :data:`BLOCK` states, each over its own narrow window.

    Rows are sparse and their finite entries sit at different cuts, so states are sorted by
    their first finite cut before they are grouped; the rows of one state stay together (and in
    key order), as :func:`_merge_senders` needs. Every entry is still extended by the same
    operations, so the programme's values do not change.
    """
    if layer.keys.size <= 2 * BLOCK:
        return [layer]
    finite = np.isfinite(layer.values)
    width = layer.values.shape[1]
    first = np.argmax(finite, axis=1)
    last = width - 1 - np.argmax(finite[:, ::-1], axis=1)
    states = layer.keys // prog.n_groups
    starts = np.flatnonzero(np.concatenate([[True], states[1:] != states[:-1]]))
    slot = np.repeat(np.arange(starts.size), np.diff(np.append(starts, states.size)))
    order = np.argsort(np.minimum.reduceat(first, starts), kind="stable")
    chunk = np.empty(starts.size, dtype=np.int64)
    chunk[order] = np.arange(starts.size) // BLOCK
    row_chunk = chunk[slot]
    rows = np.argsort(row_chunk, kind="stable")
    bounds = np.searchsorted(row_chunk[rows], np.arange(int(row_chunk.max()) + 2))
    blocks = []
    for begin, end in itertools.pairwise(bounds):
        pick = rows[begin:end]
        left, right = int(first[pick].min()), int(last[pick].max())
        values = layer.values[pick, left : right + 1]
        blocks.append(Layer(keys=layer.keys[pick], lo=layer.lo + left, values=values))
    return blocks


def _hand_over(prog: Programme, layer: Layer, cls: int) -> tuple[IntArray, int, FloatArray] | None:
    """``W_e`` per state with a free device of class ``cls``, trimmed to finite rows and columns."""
    fleet, groups = prog.fleet, prog.n_groups
    states = layer.keys // groups
    free = fleet.counts[states, cls] < fleet.sizes[cls]
    if not free.any():
        return None
    window = slice(layer.lo, layer.hi + 1)
    if groups == 1:
        every = bool(free.all())
        source = layer.values if every else layer.values[free]
        combined = prog.semiring.combine(source, prog.transfer[0, cls, window][None, :])
        states = states if every else states[free]
    else:
        combined, states = _merge_senders(prog, layer, np.flatnonzero(free), cls)
    finite = np.isfinite(combined)
    live = finite.any(axis=1)
    if not live.any():
        return None
    columns = np.flatnonzero(finite.any(axis=0))
    first, last = int(columns[0]), int(columns[-1])
    return states[live], layer.lo + first, combined[live, first : last + 1]


def _merge_senders(
    prog: Programme, layer: Layer, rows: IntArray, cls: int
) -> tuple[FloatArray, IntArray]:
    """Hand over from every sender group of each state and keep the least per state."""
    states, senders = np.divmod(layer.keys[rows], prog.n_groups)
    window = slice(layer.lo, layer.hi + 1)
    new = np.concatenate([[True], states[1:] != states[:-1]])
    if new.all():
        return prog.semiring.combine(
            layer.values[rows], prog.transfer[senders, cls, window]
        ), states
    slot = np.cumsum(new) - 1
    merged = np.full((int(slot[-1]) + 1, layer.values.shape[1]), np.inf)
    for group in np.unique(senders):
        pick = senders == group
        target = slot[pick]
        cost = prog.transfer[group, cls, window][None, :]
        part = prog.semiring.combine(layer.values[rows[pick]], cost)
        merged[target] = np.minimum(merged[target], part)
    return merged, states[new]


def _band(
    prog: Programme, cls: int, values: FloatArray, lo: int, best: float
) -> tuple[int, FloatArray] | None:
    """``min_c combine(values[:, c], stage_cost[cls][c, c'])`` for ``c'`` after the window."""
    n = prog.n
    hi = lo + values.shape[1] - 1
    least = prog.shortest[cls][: n - lo + 1]
    useful = np.flatnonzero(np.isfinite(least) & (least <= best))
    if useful.size == 0:
        return None
    out_lo, out_hi = lo + 1, min(n, hi + int(useful[-1]))
    result = np.full((values.shape[0], out_hi - out_lo + 1), np.inf)
    for offset in useful:
        last = min(hi, n - int(offset))
        width = last - lo + 1
        diagonal = prog.diagonals[cls][offset][lo : last + 1]
        candidate = prog.semiring.combine(values[:, :width], diagonal[None, :])
        target = result[:, offset - 1 : offset - 1 + width]
        np.minimum(target, candidate, out=target)
    return out_lo, result


def _assemble(prog: Programme, parts: list[_Contribution]) -> Layer:
    groups = prog.n_groups
    part_keys = [part.states * groups + prog.fleet.group_of[part.cls] for part in parts]
    keys = np.unique(np.concatenate(part_keys))
    lo = min(part.lo for part in parts)
    hi = max(part.lo + part.values.shape[1] - 1 for part in parts)
    values = np.full((keys.size, hi - lo + 1), np.inf)
    for part, key in zip(parts, part_keys, strict=True):
        rows = np.searchsorted(keys, key)
        columns = slice(part.lo - lo, part.lo - lo + part.values.shape[1])
        values[rows, columns] = np.minimum(values[rows, columns], part.values)
    return Layer(keys=keys, lo=lo, values=values)


def _best_final(prog: Programme, layer: Layer) -> float:
    if layer.hi < prog.n:
        return float(np.inf)
    return float(prog.finish(layer.values[:, prog.n - layer.lo], layer.keys).min())


def _doomed(prog: Programme, layer: Layer, remaining: int, best: float) -> npt.NDArray[np.bool_]:
    """Entries of ``layer`` that cannot lead to a chain better than ``best``."""
    positions = np.arange(layer.lo, layer.hi + 1)
    unfinished = positions < prog.n
    stuck = unfinished & (remaining == 0)
    bounds = prog.bounds
    if bounds is None:
        return stuck[None, :] | (layer.values > best)
    rest = np.where(unfinished, bounds.rest[positions] * SAFETY, 0.0)
    if prog.semiring is Semiring.MIN_MAX:
        doomed = layer.values > best
        limit = best
    else:
        doomed = layer.values + rest[None, :] > best
        limit = bounds.ceiling
    # ``rest[c] / capacity > limit`` holds on a prefix of the window (``rest`` never grows).
    cutoff = _cutoff(rest, bounds.capacity[layer.keys // prog.n_groups], limit)
    doomed |= np.arange(positions.size)[None, :] < cutoff[:, None]
    doomed[:, stuck] = True
    return doomed


def _cutoff(rest: FloatArray, capacity: FloatArray, limit: float) -> IntArray:
    """Per row, how many leading positions need a bottleneck above ``limit`` to finish.

    Capacity is zero only when no device is free: those entries are ``stuck`` anyway.
    """
    if not np.isfinite(limit):
        return np.zeros(capacity.shape, dtype=np.int64)
    cutoff = np.searchsorted(-rest, -(limit * capacity), side="left").astype(np.int64)
    cutoff[capacity <= 0] = 0
    return cutoff


def _prune(prog: Programme, layer: Layer, remaining: int, best: float) -> Layer | None:
    """Drop the doomed entries of a freshly assembled ``layer`` (its values are overwritten)."""
    values = layer.values
    np.copyto(values, np.inf, where=_doomed(prog, layer, remaining, best))
    finite = np.isfinite(values)
    rows = finite.any(axis=1)
    if not rows.any():
        return None
    columns = np.flatnonzero(finite.any(axis=0))
    first, last = int(columns[0]), int(columns[-1])
    if rows.all():
        return Layer(keys=layer.keys, lo=layer.lo + first, values=values[:, first : last + 1])
    return Layer(keys=layer.keys[rows], lo=layer.lo + first, values=values[rows, first : last + 1])


def _locate(prog: Programme, layer: Layer, t: int) -> tuple[int, int, float]:
    complete = layer.values[:, prog.n - layer.lo]
    row = int(np.argmin(prog.finish(complete, layer.keys)))
    return t, int(layer.keys[row]), float(complete[row])
