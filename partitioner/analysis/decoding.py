"""Models with per-session state (decoders with a KV cache): recognise it, keep it local, size it.

A *state pair* is a graph input and a graph output where the output is the input grown along one
axis: ``present = Concat(past, new)``. It is recognised from the graph's structure (through
``Identity``/``Cast``), never from names. When a model has state pairs, the split runs in
direct-I/O mode: each segment reads the pasts of its own layers and emits their presents, so a
layer's KV cache stays on the device that holds the layer and never crosses a cut. The model's
other inputs (token ids, attention mask, positions) are *replicated*: whatever is cheaply computed
from them alone (causal and sliding-window masks, rotary tables) is recomputed by every segment,
so only the hidden state travels between stages.

Memory: a unit's state costs ``bytes per token x context x sessions`` for the pasts its nodes
read, reserved in full on the stage that holds the unit (see :class:`SessionLimits`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.analysis.units import UnitPlan
from partitioner.errors import GraphError
from protocols.decoder import StatePair
from protocols.manifest import SessionLimits

_PASS_THROUGH = frozenset({"Identity", "Cast"})
_INTEGER_TYPES = frozenset(
    {
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.BOOL,
    }
)


@dataclass(frozen=True)
class DecoderLayout:
    """The state pairs of a model and what each past costs per token."""

    pairs: tuple[StatePair, ...]
    bytes_per_token: Mapping[str, int]
    """Per past input: bytes one more token adds to it."""

    @property
    def pasts(self) -> frozenset[str]:
        """The state inputs."""
        return frozenset(p.past for p in self.pairs)

    @property
    def names(self) -> frozenset[str]:
        """Every state input and output."""
        return frozenset(n for p in self.pairs for n in (p.past, p.present))


def replicated_inputs(model: onnx.ModelProto, layout: DecoderLayout) -> frozenset[str]:
    """The model's integer and boolean inputs other than state (token ids, attention mask,
    positions): small, so every stage may read them and rebuild what is cheaply made from them."""
    initializers = {t.name for t in model.graph.initializer}
    return frozenset(
        i.name
        for i in model.graph.input
        if i.name not in initializers
        and i.name not in layout.pasts
        and i.type.tensor_type.elem_type in _INTEGER_TYPES
    )


def find_state_pairs(graph: onnx.GraphProto) -> tuple[StatePair, ...]:
    """Input/output pairs where the output is a ``Concat`` of the input and something new."""
    initializers = {t.name for t in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initializers}
    producer = {o: n for n in graph.node for o in n.output if o}
    pairs: list[StatePair] = []
    for output in graph.output:
        node = _skip_pass_through(producer.get(output.name), producer)
        if node is None or node.op_type != "Concat":
            continue
        sources = [_source(name, producer) for name in node.input]
        pasts = [name for name in sources if name in inputs]
        if len(pasts) != 1:
            continue
        rank = len(inputs[pasts[0]].type.tensor_type.shape.dim)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        pairs.append(StatePair(past=pasts[0], present=output.name, axis=axis % max(rank, 1)))
    return tuple(pairs)


def _skip_pass_through(
    node: onnx.NodeProto | None, producer: Mapping[str, onnx.NodeProto]
) -> onnx.NodeProto | None:
    while node is not None and node.op_type in _PASS_THROUGH:
        node = producer.get(node.input[0])
    return node


def _source(name: str, producer: Mapping[str, onnx.NodeProto]) -> str:
    node = producer.get(name)
    while node is not None and node.op_type in _PASS_THROUGH:
        name = node.input[0]
        node = producer.get(name)
    return name


def decoder_layout(model: onnx.ModelProto) -> DecoderLayout | None:
    """The model's state pairs and their per-token sizes; ``None`` for a stateless model.

    Raises :class:`GraphError` when a past input's shape is not fixed apart from its state axis
    (its per-token size would be unknown).
    """
    pairs = find_state_pairs(model.graph)
    if not pairs:
        return None
    declared = {i.name: i for i in model.graph.input}
    sizes: dict[str, int] = {}
    for pair in pairs:
        tensor = declared[pair.past].type.tensor_type
        dims = list(tensor.shape.dim)
        per_token = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        for axis, dim in enumerate(dims):
            if axis == pair.axis:
                continue
            if not dim.HasField("dim_value"):
                if axis == 0:  # the batch axis: one sequence per session
                    continue
                raise GraphError(f"state input {pair.past!r} has a free dimension on axis {axis}")
            per_token *= dim.dim_value
        sizes[pair.past] = per_token
    return DecoderLayout(pairs, sizes)


def unit_state_bytes(
    index: GraphIndex,
    frontier: Frontier,
    units: UnitPlan,
    layout: DecoderLayout,
    sessions: SessionLimits,
) -> list[int]:
    """Per unit: the state memory its pasts need at ``sessions`` (reserved in full)."""
    scale = sessions.max_sessions * sessions.max_context
    out: list[int] = []
    for unit in units.units:
        read = {
            name
            for node in frontier.order[unit.start : unit.end]
            for name in index.node_inputs[node]
            if name in layout.bytes_per_token
        }
        out.append(scale * sum(layout.bytes_per_token[name] for name in read))
    return out


def segment_state(
    inputs: Sequence[str], outputs: Sequence[str], layout: DecoderLayout
) -> list[StatePair]:
    """The state pairs a segment keeps; raises :class:`GraphError` if one is split in two."""
    ins, outs = set(inputs), set(outputs)
    kept: list[StatePair] = []
    for pair in layout.pairs:
        if (pair.past in ins) != (pair.present in outs):
            raise GraphError(f"state {pair.past!r} -> {pair.present!r} is split across segments")
        if pair.past in ins:
            kept.append(pair)
    return kept


def describe_state(total_bytes: int, sessions: SessionLimits) -> str:
    """Plain words for an error message about state memory."""
    mib = total_bytes / 2**20
    per = math.ceil(total_bytes / sessions.max_sessions) / 2**20 if sessions.max_sessions else 0
    return (
        f"the plan reserves {mib:.1f} MiB of KV cache ({per:.1f} MiB per session) for "
        f"{sessions.max_sessions} concurrent session(s) of {sessions.max_context} tokens; "
        "fewer sessions or a shorter context need less"
    )
