"""Execution order of the main nodes and the frontier at every cut between them.

Cut ``c`` (``0 <= c <= M`` for ``M`` main nodes) separates positions ``< c`` from ``>= c``. A
tensor *crosses* cut ``c`` when it is produced before it and needed at or after it; every
crossing tensor must be handed from the segment before the cut to the segment after it.

Two ways of treating the model's own inputs and outputs:

- ``carry_io=True`` (default): inputs enter the first segment and are handed along to the
  segments that use them; an output made early is handed along to the end. Each segment's inputs
  are then exactly the previous segment's outputs.
- ``carry_io=False``: each segment reads the model inputs it uses directly and emits the model
  outputs it makes (what a decoder's per-stage KV cache needs).

Static tensors never cross a cut, except shape leaves whose activation is not itself crossing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from partitioner.analysis.costs import ShapeTable
from partitioner.analysis.graph import GraphIndex

Span = tuple[int, int]
"""``(lo, hi)``: the tensor crosses every cut ``c`` with ``lo < c <= hi``."""


@dataclass(frozen=True)
class Frontier:
    """Main-node order plus, for every tensor that ever crosses a cut, its crossing span."""

    order: tuple[int, ...]
    """Main node indices in execution order (a topological order)."""
    position: Mapping[int, int]
    spans: Mapping[str, Span]
    bytes_at: tuple[int, ...]
    """Frontier bytes at each cut ``0..M`` at the sample binding."""
    carry_io: bool

    @property
    def size(self) -> int:
        """Number of main nodes ``M``."""
        return len(self.order)

    def crossing(self, cut: int) -> tuple[str, ...]:
        """Tensors crossing ``cut``, in a stable order."""
        return tuple(name for name, (lo, hi) in self.spans.items() if lo < cut <= hi)


def static_leaves(index: GraphIndex) -> dict[str, frozenset[str]]:
    """For every static tensor, the shape leaves its value depends on."""
    leaves: dict[str, frozenset[str]] = {}
    for i in sorted(index.static):
        node = index.nodes[i]
        outs = [o for o in node.output if o]
        if outs and outs[0] in index.leaf_anchor:
            found = frozenset(outs)
        else:
            found = frozenset().union(*(leaves.get(n, frozenset()) for n in index.node_inputs[i]))
        for out in outs:
            leaves[out] = found
    return leaves


def build_frontier(
    index: GraphIndex, table: ShapeTable, *, carry_io: bool = True, alap: bool | None = None
) -> Frontier:
    """The frontier for the file order or the as-late-as-possible order.

    ``alap=None`` tries both and keeps the one with the smaller total frontier (summed over all
    cuts), preferring the file order on a tie.
    """
    leaves = static_leaves(index)
    file_order = index.main
    if alap is False:
        return _frontier(index, table, leaves, file_order, carry_io)
    late = _alap_order(index, leaves, file_order)
    if alap:
        return _frontier(index, table, leaves, late, carry_io)
    first = _frontier(index, table, leaves, file_order, carry_io)
    if late == file_order:
        return first
    second = _frontier(index, table, leaves, late, carry_io)
    return second if sum(second.bytes_at) < sum(first.bytes_at) else first


def main_dependencies(
    index: GraphIndex, leaves: Mapping[str, frozenset[str]], node: int
) -> set[int]:
    """Main nodes that ``node`` depends on directly or through static nodes."""
    deps: set[int] = set()
    for name in _needs(index, leaves, index.node_inputs[node]):
        producer = index.producer.get(name)
        if producer is not None and producer not in index.static:
            deps.add(producer)
    return deps


def _needs(
    index: GraphIndex, leaves: Mapping[str, frozenset[str]], names: Iterable[str]
) -> set[str]:
    """Non-static tensors read by ``names``: themselves, or the anchors behind static ones."""
    found: set[str] = set()
    for name in names:
        if index.is_static_tensor(name):
            found.update(index.leaf_anchor[leaf] for leaf in leaves.get(name, ()))
        else:
            found.add(name)
    return found


def _alap_order(
    index: GraphIndex, leaves: Mapping[str, frozenset[str]], file_order: tuple[int, ...]
) -> tuple[int, ...]:
    """Every main node as late as its consumers allow: sorted by latest start, then file order.

    A node's latest start is one less than the earliest latest start of the nodes that need
    it; nodes nothing needs start last. Sorting by it is a topological order.
    """
    users: dict[int, list[int]] = {n: [] for n in file_order}
    for n in file_order:
        for d in main_dependencies(index, leaves, n):
            users[d].append(n)
    latest: dict[int, int] = {}
    for n in reversed(file_order):
        latest[n] = min((latest[u] - 1 for u in users[n]), default=0)
    rank = {n: p for p, n in enumerate(file_order)}
    return tuple(sorted(file_order, key=lambda n: (latest[n], rank[n])))


def _frontier(
    index: GraphIndex,
    table: ShapeTable,
    leaves: Mapping[str, frozenset[str]],
    order: tuple[int, ...],
    carry_io: bool,
) -> Frontier:
    size = len(order)
    position = {n: p for p, n in enumerate(order)}
    last_use, leaf_use = _last_uses(index, leaves, order, carry_io)

    def lo_of(name: str) -> int:
        producer = index.producer.get(name)
        return -1 if producer is None else position[producer]

    spans: dict[str, Span] = {}
    for name, hi in last_use.items():
        if name in index.inputs and not carry_io:
            continue
        if hi > lo_of(name):
            spans[name] = (lo_of(name), hi)
    _add_leaf_spans(spans, index, last_use, leaf_use, lo_of, carry_io)
    return Frontier(
        order=order,
        position=position,
        spans=spans,
        bytes_at=_bytes_at(spans, table, size),
        carry_io=carry_io,
    )


def _last_uses(
    index: GraphIndex,
    leaves: Mapping[str, frozenset[str]],
    order: tuple[int, ...],
    carry_io: bool,
) -> tuple[dict[str, int], dict[str, int]]:
    """The last position each dynamic tensor is read at, and each static leaf (a graph output
    counts as read after the last node; only with ``carry_io`` when it is dynamic)."""
    last_use: dict[str, int] = {}
    leaf_use: dict[str, int] = {}

    def use(names: Iterable[str], at: int, *, outputs: bool = False) -> None:
        for name in names:
            if index.is_static_tensor(name):
                for leaf in leaves.get(name, ()):
                    leaf_use[leaf] = max(leaf_use.get(leaf, -1), at)
            elif carry_io or not outputs:
                last_use[name] = max(last_use.get(name, -1), at)

    for p, n in enumerate(order):
        use(index.node_inputs[n], p)
    use(index.outputs, len(order), outputs=True)
    return last_use, leaf_use


def _add_leaf_spans(
    spans: dict[str, Span],
    index: GraphIndex,
    last_use: Mapping[str, int],
    leaf_use: Mapping[str, int],
    lo_of: Callable[[str], int],
    carry_io: bool,
) -> None:
    """Add the span of every static leaf: live from its anchor until its last use."""
    for leaf, hi in leaf_use.items():
        anchor = index.leaf_anchor[leaf]
        if anchor in index.inputs:
            if not carry_io:
                continue
            spans[anchor] = (-1, max(spans.get(anchor, (-1, 0))[1], 0))
        lo = max(lo_of(anchor), last_use.get(anchor, lo_of(anchor)))
        if anchor in index.inputs:
            lo = max(lo, 0)
        if hi > lo:
            spans[leaf] = (lo, hi)


def _bytes_at(spans: Mapping[str, Span], table: ShapeTable, size: int) -> tuple[int, ...]:
    delta = [0] * (size + 2)
    for name, (lo, hi) in spans.items():
        nbytes = table.nbytes(name)
        delta[lo + 1] += nbytes
        delta[hi + 1] -= nbytes
    running = 0
    out: list[int] = []
    for c in range(size + 1):
        running += delta[c]
        out.append(running)
    return tuple(out)
