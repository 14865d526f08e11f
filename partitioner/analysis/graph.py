"""Structure of an ONNX graph: who produces and consumes each tensor, and which nodes are static.

A node is *static* when its value does not depend on the values flowing through the model, only
on constants, weights and the *shapes* of activations: ``Constant`` nodes, ``Shape``/``Size`` and
everything computed from them and from initializers (shape arithmetic, causal masks built with
``Range``, weight-only preprocessing such as ``DequantizeLinear`` of a quantized weight). Static
nodes are never cut: every segment that needs a static tensor recomputes it. The only static
tensors that ever travel between segments are *shape leaves* (the output of ``Shape``/``Size``
of an activation), and only when that activation is not available in the later segment.

Model inputs can be declared *replicated* (a decoder's ``attention_mask`` and ``position_ids``):
nodes computed from them, constants and small initializers only (causal masks, rotary tables)
are then static too, so each segment rebuilds them from those small inputs instead of receiving
them. A node that reads an initializer over :data:`REPLICATE_MAX_INITIALIZER_BYTES` (an
embedding table) stays a main node.

Every other node is a *main* node; cuts are placed between main nodes. Nothing here looks at
tensor or node names.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import onnx

from partitioner.analysis.costs import tensor_proto_bytes
from partitioner.errors import GraphError

SHAPE_READERS = frozenset({"Shape", "Size"})
"""Ops that read only the shape of their input, never its values."""

NONDETERMINISTIC = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)
"""Ops whose output differs from run to run: never recomputed."""

_STANDARD_DOMAINS = frozenset({"", "ai.onnx"})
REPLICATE_MAX_INITIALIZER_BYTES = 1 << 16
"""Largest initializer a node computed from replicated inputs may read and stay static."""


@dataclass(frozen=True)
class GraphIndex:
    """Producers, consumers and the static/main split of one (topologically sorted) graph."""

    nodes: tuple[onnx.NodeProto, ...]
    """Live nodes in a valid topological order (the file's order when it is valid)."""
    node_inputs: tuple[tuple[str, ...], ...]
    """Per node: its non-empty inputs plus outer-scope names its subgraphs read, no repeats."""
    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    inputs: tuple[str, ...]
    """Graph inputs that are not initializers (the values a caller feeds)."""
    outputs: tuple[str, ...]
    initializers: Mapping[str, onnx.TensorProto]
    sparse_initializers: frozenset[str]
    static: frozenset[int]
    """Indices of static (recomputable) nodes."""
    leaf_anchor: Mapping[str, str]
    """Shape leaves: output of ``Shape``/``Size`` of an activation → that activation."""

    @property
    def main(self) -> tuple[int, ...]:
        """Indices of main (non-static) nodes in file order."""
        return tuple(i for i in range(len(self.nodes)) if i not in self.static)

    def is_static_tensor(self, name: str) -> bool:
        """Whether ``name`` is produced by a static node or is an initializer."""
        if name in self.initializers or name in self.sparse_initializers:
            return True
        node = self.producer.get(name)
        return node is not None and node in self.static

    def static_producers(self, names: Iterable[str]) -> Iterator[int]:
        """Static nodes producing any of ``names`` directly."""
        for name in names:
            node = self.producer.get(name)
            if node is not None and node in self.static:
                yield node


def subgraph_references(node: onnx.NodeProto) -> list[str]:
    """Names a node's subgraphs (``If``/``Loop``/``Scan`` bodies) read from the outer scope."""
    refs: list[str] = []
    for attr in node.attribute:
        graphs = list(attr.graphs)
        if attr.HasField("g"):
            graphs.append(attr.g)
        for sub in graphs:
            refs.extend(_outer_names(sub))
    return list(dict.fromkeys(refs))


def _outer_names(graph: onnx.GraphProto) -> list[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used: list[str] = []
    for node in graph.node:
        for name in [*node.input, *subgraph_references(node)]:
            if name and name not in defined:
                used.append(name)
        defined.update(o for o in node.output if o)
    used.extend(o.name for o in graph.output if o.name not in defined)
    return used


def index_graph(
    graph: onnx.GraphProto, *, replicated_inputs: frozenset[str] = frozenset()
) -> GraphIndex:
    """Index ``graph``: sort it, drop nodes nothing needs, and split static from main nodes.

    ``replicated_inputs`` are model inputs whose cheap consequences count as static (see the
    module docstring). Raises :class:`GraphError` when the graph has a cycle or reads a tensor
    nobody defines.
    """
    initializers = {t.name: t for t in graph.initializer}
    sparse = frozenset(t.values.name for t in graph.sparse_initializer)
    inputs = tuple(
        i.name for i in graph.input if i.name not in initializers and i.name not in sparse
    )
    outputs = tuple(o.name for o in graph.output)
    raw_inputs = [_node_inputs(n) for n in graph.node]
    defined = set(inputs) | set(initializers) | sparse
    order = _topological_order(list(graph.node), raw_inputs, defined)
    order = _live_nodes(list(graph.node), raw_inputs, order, outputs)
    nodes = tuple(graph.node[i] for i in order)
    node_inputs = tuple(raw_inputs[i] for i in order)
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node_inputs[i]:
            consumers.setdefault(name, []).append(i)
        for name in node.output:
            if name:
                producer[name] = i
    for name in outputs:
        if name not in producer and name not in defined:
            raise GraphError(f"graph output {name!r} is not produced by any node")
    unknown = replicated_inputs - set(inputs)
    if unknown:
        raise GraphError(f"replicated inputs {sorted(unknown)} are not inputs of the graph")
    big = {
        n
        for n, t in initializers.items()
        if tensor_proto_bytes(t) > REPLICATE_MAX_INITIALIZER_BYTES
    }
    static, leaves = _classify(
        nodes, node_inputs, producer, set(initializers) | sparse, replicated_inputs, big | sparse
    )
    return GraphIndex(
        nodes=nodes,
        node_inputs=node_inputs,
        producer=producer,
        consumers={k: tuple(v) for k, v in consumers.items()},
        inputs=inputs,
        outputs=outputs,
        initializers=initializers,
        sparse_initializers=sparse,
        static=static,
        leaf_anchor=leaves,
    )


def _node_inputs(node: onnx.NodeProto) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*(i for i in node.input if i), *subgraph_references(node)]))


def _topological_order(
    nodes: list[onnx.NodeProto], node_inputs: list[tuple[str, ...]], defined: set[str]
) -> list[int]:
    """Kahn's algorithm, always taking the earliest ready node: the file order if it is valid."""
    producer = {name: i for i, n in enumerate(nodes) for name in n.output if name}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = {}
    for i, names in enumerate(node_inputs):
        for name in set(names):
            if name in producer:
                waiting[i] += 1
                users.setdefault(producer[name], []).append(i)
            elif name not in defined:
                raise GraphError(
                    f"node {i} ({nodes[i].op_type}) reads {name!r}, which nothing defines"
                )
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for user in users.get(i, []):
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(nodes):
        raise GraphError("the graph has a cycle")
    return order


def _live_nodes(
    nodes: list[onnx.NodeProto],
    node_inputs: list[tuple[str, ...]],
    order: list[int],
    outputs: tuple[str, ...],
) -> list[int]:
    """Keep only nodes some graph output depends on (dead code is never exported)."""
    needed = set(outputs)
    live: list[int] = []
    for i in reversed(order):
        if any(name in needed for name in nodes[i].output if name):
            live.append(i)
            needed.update(node_inputs[i])
    live.reverse()
    return live


def _classify(
    nodes: tuple[onnx.NodeProto, ...],
    node_inputs: tuple[tuple[str, ...], ...],
    producer: Mapping[str, int],
    constants: set[str],
    replicated: frozenset[str] = frozenset(),
    big: set[str] | frozenset[str] = frozenset(),
) -> tuple[frozenset[int], dict[str, str]]:
    static: set[int] = set()
    leaves: dict[str, str] = {}
    derived: set[str] = set(replicated)
    """Tensors computed from replicated inputs (recomputed only if cheap)."""

    def is_static(name: str) -> bool:
        return (
            name in constants
            or name in replicated
            or (name in producer and producer[name] in static)
        )

    for i, node in enumerate(nodes):
        if node.domain not in _STANDARD_DOMAINS or node.op_type in NONDETERMINISTIC:
            continue
        if any(a.HasField("g") or a.graphs for a in node.attribute):
            continue
        names = node_inputs[i]
        if node.op_type in SHAPE_READERS and len(names) == 1:
            static.add(i)
            if not is_static(names[0]):
                leaves.update({out: names[0] for out in node.output if out})
        elif all(is_static(name) for name in names):
            if any(name in derived for name in names):
                if any(name in big for name in names):
                    continue
                derived.update(out for out in node.output if out)
            static.add(i)
    return frozenset(static), leaves
