"""Group main nodes into planning units between good cuts, and cost each unit.

A cut is *good* when its frontier is (within a small tolerance) the smallest in a wide window of
cuts around it: between transformer layers, between residual blocks, after the embedding. Good
cuts become unit boundaries (see :func:`choose_boundaries`); oversized units are split at their
cheapest cut, and when there are more than ``max_units`` units the cuts with the largest
frontier go first (on a tie, the one whose removal makes the smaller merged unit), so units stay
balanced and every remaining boundary is cheap to cut at.

Per unit: FLOPs (its main nodes plus the static nodes it recomputes), weight bytes (its own
initializers; an initializer several units read is reported as shared instead), out bytes (the
frontier at its end) and peak activation workspace (largest live set while it runs).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from partitioner.analysis.costs import ShapeTable, node_flops
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.analysis.runtime_memory import packed_extra_bytes, resident_weight_bytes

DEFAULT_MAX_UNITS = 128
DEFAULT_MIN_UNITS = 8
SHARED_MIN_BYTES = 4096
"""Initializers read by several units and at least this big become shared weights; smaller
ones are simply counted in every unit that reads them."""
GOOD_CUT_TOLERANCE = 0.05


@dataclass(frozen=True)
class GraphUnit:
    """Main nodes at positions ``[start, end)`` of the frontier's order, with their costs."""

    name: str
    start: int
    end: int
    flops: int
    weight_bytes: int
    """Resident bytes of the initializers only this unit reads (shared ones excluded): their
    stored size, half-precision ones as float32 (see
    :func:`~partitioner.analysis.runtime_memory.resident_weight_bytes`)."""
    out_bytes: int
    workspace_bytes: int
    initializers: frozenset[str]
    """Every initializer the unit reads, shared ones included."""


@dataclass(frozen=True)
class SharedInitializer:
    """An initializer read by several units (tied embeddings and the like)."""

    name: str
    nbytes: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class UnitPlan:
    """The chain of units the planner places."""

    units: tuple[GraphUnit, ...]
    boundaries: tuple[int, ...]
    """Cut positions: ``boundaries[k]`` starts unit ``k``; the last one is ``M``."""
    input_bytes: int
    shared: tuple[SharedInitializer, ...]


def choose_boundaries(
    frontier: Frontier, costs: Sequence[float], max_units: int, min_units: int = DEFAULT_MIN_UNITS
) -> list[int]:
    """Cut positions ``0 = b0 < b1 < ... < bn = M`` at good cuts, at most ``max_units`` units.

    ``costs[p]`` is the relative cost of the main node at position ``p``. Steps:

    1. good cuts: frontier within :data:`GOOD_CUT_TOLERANCE` of the smallest frontier within
       ``M / 8`` positions either side (the scale of a block or layer);
    2. of consecutive good cuts with next to nothing between them, keep the one with the
       smaller frontier;
    3. split any unit costing more than ``1 / min_units`` of the model at its smallest
       frontier among fairly even splits;
    4. drop the worst cuts until at most ``max_units`` units remain.
    """
    size = frontier.size
    f = frontier.bytes_at
    if size <= 1:
        return [0, size]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    floor = _window_min(f[1:size], max(1, size // 8))
    good = [c for c in range(1, size) if f[c] <= (1 + GOOD_CUT_TOLERANCE) * floor[c - 1]]
    tiny = prefix[-1] / (4 * max(1, max_units))
    cuts = _collapse(good, f, prefix, tiny)
    cuts = [c for c in cuts if prefix[c] >= tiny and prefix[-1] - prefix[c] >= tiny]
    cuts = _refine(cuts, f, prefix, prefix[-1] / max(1, min_units), size)
    return [0, *_thin(cuts, f, costs, max(0, max_units - 1), size), size]


def _window_min(values: Sequence[int], half: int) -> list[int]:
    """``out[i] = min(values[i - half : i + half + 1])`` (clipped), in linear time."""
    out: list[int] = []
    window: deque[int] = deque()
    n = len(values)
    for right in range(n + half):
        if right < n:
            while window and values[window[-1]] >= values[right]:
                window.pop()
            window.append(right)
        centre = right - half
        if centre >= 0:
            while window[0] < centre - half:
                window.popleft()
            out.append(values[window[0]])
    return out


def _collapse(cuts: list[int], f: Sequence[int], prefix: Sequence[float], tiny: float) -> list[int]:
    """Cluster cuts less than ``tiny`` cost after a cluster's first cut; keep one per cluster.

    The kept cut has the smallest frontier, the latest on a tie: on a plateau of equal frontiers
    the later cut keeps elementwise follow-ups (a normalisation after a residual add, a cast)
    in the segment that made their input, where the runtime can fuse them.
    """
    kept: list[int] = []
    start = -1
    for c in cuts:
        if kept and prefix[c] - prefix[start] < tiny:
            if f[c] <= f[kept[-1]]:
                kept[-1] = c
            continue
        start = c
        kept.append(c)
    return kept


def _refine(
    cuts: list[int], f: Sequence[int], prefix: Sequence[float], cap: float, size: int
) -> list[int]:
    """Split every unit costing more than ``cap``, recursively.

    The split goes at the smallest frontier among cuts leaving at least a quarter of the unit's
    cost on each side (ties go to the most even split); if no cut does (one node dominates),
    at the most even split.
    """
    result: list[int] = []
    todo = list(zip([0, *cuts], [*cuts, size], strict=True))
    while todo:
        lo, hi = todo.pop()
        cost = prefix[hi] - prefix[lo]
        if hi - lo < 2 or cost <= cap:
            if hi < size:
                result.append(hi)
            continue
        middle = (prefix[lo] + prefix[hi]) / 2
        inner = range(lo + 1, hi)
        even = [c for c in inner if abs(prefix[c] - middle) <= cost / 4]
        if even:
            best = min(even, key=lambda c: (f[c], abs(prefix[c] - middle)))
        else:
            best = min(inner, key=lambda c: (abs(prefix[c] - middle), f[c]))
            best = _before_free_nodes(best, lo, f, prefix, cost)
            if best == lo:  # only free nodes before the dominant one: nothing worth cutting
                if hi < size:
                    result.append(hi)
                continue
        todo.extend([(lo, best), (best, hi)])
    return sorted(result)


FREE_NODE_SHARE = 1e-3
"""A node costing at most this share of its unit is free to move across a cut (a ``Concat``,
a ``Slice``, a ``Cast``)."""


def _before_free_nodes(
    cut: int, lo: int, f: Sequence[int], prefix: Sequence[float], cost: float
) -> int:
    """``cut`` moved back over the free nodes before it while that does not grow the frontier.

    A dominant node's most even split lands right before it; nodes that only reshape its
    operand (a row padding's ``Concat`` and ``Slice``) can make the tensor crossing there larger
    than the one before them, which a pass would then hand over at that size.
    """
    while cut > lo and prefix[cut] - prefix[cut - 1] <= FREE_NODE_SHARE * cost:
        if f[cut - 1] > f[cut]:
            break
        cut -= 1
    return cut


def _thin(
    cuts: list[int], f: Sequence[int], costs: Sequence[float], keep: int, size: int
) -> list[int]:
    """Drop the worst cuts (largest frontier, then smallest merged unit) until ``keep`` remain."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(cuts)
    left = list(range(-1, n - 1))
    right = list(range(1, n + 1))
    version = [0] * n

    def key(i: int) -> tuple[int, float, int]:
        lo = cuts[left[i]] if left[i] >= 0 else 0
        hi = cuts[right[i]] if right[i] < n else size
        return (-f[cuts[i]], prefix[hi] - prefix[lo], i)

    heap = [(key(i), 0, i) for i in range(n)]
    heapq.heapify(heap)
    alive = n
    removed = [False] * n
    while alive > keep and heap:
        _, ver, i = heapq.heappop(heap)
        if removed[i] or ver != version[i]:
            continue
        removed[i] = True
        alive -= 1
        lo, hi = left[i], right[i]
        if lo >= 0:
            right[lo] = hi
        if hi < n:
            left[hi] = lo
        for j in (lo, hi):
            if 0 <= j < n and not removed[j]:
                version[j] += 1
                heapq.heappush(heap, (key(j), version[j], j))
    return [c for i, c in enumerate(cuts) if not removed[i]]


def build_units(
    index: GraphIndex,
    frontier: Frontier,
    table: ShapeTable,
    *,
    max_units: int = DEFAULT_MAX_UNITS,
) -> UnitPlan:
    """Choose unit boundaries and cost every unit."""
    closures = StaticClosures(index)
    node_cost = [node_flops(n, index.node_inputs[i], table) for i, n in enumerate(index.nodes)]
    weights = {name: resident_weight_bytes(t) for name, t in index.initializers.items()}
    for name, extra in packed_extra_bytes(index.nodes, index.initializers).items():
        weights[name] += extra
    total_flops = max(1, sum(node_cost[n] for n in frontier.order))
    total_weights = max(1, sum(weights.values()))
    costs = [
        node_cost[n] / total_flops + _direct_weight(index, n, weights) / total_weights
        for n in frontier.order
    ]
    bounds = choose_boundaries(frontier, costs, max_units)
    last_use = _last_main_use(index, frontier)
    raw: list[tuple[int, int, int, int, frozenset[str]]] = []
    for start, end in itertools.pairwise(bounds):
        nodes = frontier.order[start:end]
        statics = closures.of(n for n in nodes)
        flops = sum(node_cost[n] for n in nodes) + sum(node_cost[s] for s in statics)
        inits = frozenset(
            name
            for n in (*nodes, *statics)
            for name in index.node_inputs[n]
            if name in index.initializers
        )
        workspace = _workspace(index, frontier, table, start, end, last_use)
        raw.append((start, end, flops, workspace, inits))
    readers: dict[str, list[int]] = {}
    for k, (*_, inits) in enumerate(raw):
        for name in inits:
            readers.setdefault(name, []).append(k)
    shared = tuple(
        SharedInitializer(name, weights[name], tuple(ks))
        for name, ks in readers.items()
        if len(ks) > 1 and weights[name] >= SHARED_MIN_BYTES
    )
    shared_names = {s.name for s in shared}
    units = tuple(
        GraphUnit(
            name=_label(index, frontier.order[start:end], k),
            start=start,
            end=end,
            flops=flops,
            weight_bytes=sum(weights[n] for n in inits if n not in shared_names),
            out_bytes=frontier.bytes_at[end],
            workspace_bytes=workspace,
            initializers=inits,
        )
        for k, (start, end, flops, workspace, inits) in enumerate(raw)
    )
    return UnitPlan(
        units=units,
        boundaries=tuple(bounds),
        input_bytes=frontier.bytes_at[0],
        shared=shared,
    )


def _direct_weight(index: GraphIndex, node: int, weights: Mapping[str, int]) -> int:
    return sum(weights.get(name, 0) for name in index.node_inputs[node])


class StaticClosures:
    """Static nodes needed to recompute a set of tensors, stopping at activations."""

    def __init__(self, index: GraphIndex) -> None:
        self._index = index

    def of(self, nodes: Iterable[int]) -> set[int]:
        """Static nodes the given nodes' inputs need (depth-first, each visited once)."""
        index = self._index
        found: set[int] = set()
        stack = [p for n in nodes for p in index.static_producers(index.node_inputs[n])]
        while stack:
            node = stack.pop()
            if node not in found:
                found.add(node)
                stack.extend(index.static_producers(index.node_inputs[node]))
        return found


def _last_main_use(index: GraphIndex, frontier: Frontier) -> dict[str, int]:
    last: dict[str, int] = {}
    for p, n in enumerate(frontier.order):
        for name in index.node_inputs[n]:
            last[name] = p
    return last


def _workspace(
    index: GraphIndex,
    frontier: Frontier,
    table: ShapeTable,
    start: int,
    end: int,
    last_use: Mapping[str, int],
) -> int:
    """Largest total size of tensors made inside ``[start, end)`` that are alive at once."""
    live: dict[str, int] = {}
    peak = 0
    for p in range(start, end):
        node = index.nodes[frontier.order[p]]
        for out in node.output:
            if out:
                live[out] = table.nbytes(out)
        peak = max(peak, sum(live.values()))
        for name in [
            n for n in live if last_use.get(n, -1) <= p and not _crosses(frontier, n, end)
        ]:
            del live[name]
    return peak


def _crosses(frontier: Frontier, name: str, cut: int) -> bool:
    span = frontier.spans.get(name)
    return span is not None and span[0] < cut <= span[1]


def _label(index: GraphIndex, nodes: Sequence[int], k: int) -> str:
    ops = Counter(index.nodes[n].op_type for n in nodes)
    top = ",".join(f"{op}x{count}" if count > 1 else op for op, count in ops.most_common(3))
    return f"u{k}:{top}"
