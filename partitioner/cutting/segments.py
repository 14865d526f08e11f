"""Cut a model into segments: one self-contained ``ModelProto`` per range of main nodes.

Like ``onnx.utils.Extractor`` but driven by the frontier: a segment's inputs are the tensors
crossing its first cut, its outputs those crossing its last cut (the model outputs for the last
segment), and it carries its own copy of every static node and initializer it needs, so
constants and shape arithmetic are recomputed rather than handed off. Nodes keep the file's
relative order. Running the segments in order, each fed by name from the model inputs and the
earlier segments' outputs, reproduces the model's outputs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import onnx

from partitioner.analysis.costs import ShapeTable, tensor_proto_bytes
from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.errors import GraphError

SEGMENT_METADATA_KEY = "fedshard.segment"


@dataclass(frozen=True)
class SegmentSpec:
    """What one segment holds: main positions ``[start, end)`` and everything that implies."""

    index: int
    start: int
    end: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[int, ...]
    """Node indices (main and recomputed static) in file order."""
    initializers: tuple[str, ...]
    param_bytes: int


def plan_segments(index: GraphIndex, frontier: Frontier, cuts: Sequence[int]) -> list[SegmentSpec]:
    """Segment specs for cut positions ``0 = cuts[0] < ... < cuts[-1] = M``.

    Raises :class:`GraphError` if the cuts are not strictly increasing from 0 to ``M``.
    """
    size = frontier.size
    rising = all(a < b for a, b in itertools.pairwise(cuts))
    if list(cuts[:1]) != [0] or cuts[-1] != size or not rising:
        raise GraphError(f"cuts must rise strictly from 0 to {size}, got {list(cuts)}")
    made_by_main = {o for n in frontier.order for o in index.nodes[n].output if o}
    specs: list[SegmentSpec] = []
    for k, (start, end) in enumerate(itertools.pairwise(cuts)):
        main = frontier.order[start:end]
        produced = {o for n in main for o in index.nodes[n].output if o}
        inputs = list(frontier.crossing(start))
        last = end == size
        if frontier.carry_io:
            outputs = list(index.outputs) if last else list(frontier.crossing(end))
        else:
            outputs = list(frontier.crossing(end)) if not last else []
            outputs += [
                o for o in index.outputs if o in produced or (last and o not in made_by_main)
            ]
        outputs = list(dict.fromkeys(outputs))
        demand = [name for n in main for name in index.node_inputs[n]] + outputs
        statics, inits = _resolve(
            index, demand, inputs, produced, allow_inputs=not frontier.carry_io
        )
        nodes = tuple(sorted({*main, *statics}))
        specs.append(
            SegmentSpec(
                index=k,
                start=start,
                end=end,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                nodes=nodes,
                initializers=tuple(sorted(inits)),
                param_bytes=sum(tensor_proto_bytes(index.initializers[i]) for i in inits),
            )
        )
    return specs


def _resolve(
    index: GraphIndex,
    demand: Sequence[str],
    inputs: list[str],
    produced: set[str],
    *,
    allow_inputs: bool,
) -> tuple[set[int], set[str]]:
    """Static nodes and initializers needed to make ``demand`` from ``inputs`` and ``produced``.

    With ``allow_inputs`` a model input the segment needs is added to ``inputs``.
    """
    statics: set[int] = set()
    inits: set[str] = set()
    have = set(inputs) | produced
    stack = list(reversed(demand))
    while stack:
        name = stack.pop()
        if name in have:
            continue
        have.add(name)
        if name in index.initializers or name in index.sparse_initializers:
            inits.add(name)
        elif name in index.inputs and allow_inputs:
            inputs.append(name)
        elif name in index.producer and index.producer[name] in index.static:
            node = index.producer[name]
            statics.add(node)
            have.update(o for o in index.nodes[node].output if o)
            stack.extend(reversed(index.node_inputs[node]))
        else:
            raise GraphError(f"tensor {name!r} is needed in a segment but not available there")
    return statics, inits


def build_segment(
    model: onnx.ModelProto,
    index: GraphIndex,
    spec: SegmentSpec,
    types: Mapping[str, onnx.ValueInfoProto],
    table: ShapeTable,
) -> onnx.ModelProto:
    """The segment as a standalone model (weights copied in)."""
    graph = onnx.GraphProto(name=f"{model.graph.name or 'model'}_segment{spec.index}")
    graph.node.extend(index.nodes[i] for i in spec.nodes)
    sparse = {t.values.name: t for t in model.graph.sparse_initializer}
    for name in spec.initializers:
        if name in sparse:
            graph.sparse_initializer.append(sparse[name])
        else:
            graph.initializer.append(index.initializers[name])
    graph.input.extend(_value_info(name, types, table) for name in spec.inputs)
    graph.output.extend(_value_info(name, types, table) for name in spec.outputs)
    inside = {o for i in spec.nodes for o in index.nodes[i].output if o}
    io = set(spec.inputs) | set(spec.outputs)
    graph.value_info.extend(
        vi for vi in model.graph.value_info if vi.name in inside and vi.name not in io
    )
    segment = onnx.ModelProto(
        ir_version=model.ir_version,
        producer_name="fedshard",
        graph=graph,
        model_version=model.model_version,
    )
    segment.opset_import.extend(model.opset_import)
    segment.functions.extend(model.functions)
    entry = segment.metadata_props.add()
    entry.key = SEGMENT_METADATA_KEY
    entry.value = json.dumps(
        {"index": spec.index, "inputs": list(spec.inputs), "outputs": list(spec.outputs)}
    )
    return segment


def iter_segments(
    model: onnx.ModelProto,
    index: GraphIndex,
    specs: Sequence[SegmentSpec],
    types: Mapping[str, onnx.ValueInfoProto],
    table: ShapeTable,
) -> Iterator[onnx.ModelProto]:
    """Build the segments one at a time (so only one copy of a segment's weights is alive)."""
    for spec in specs:
        yield build_segment(model, index, spec, types, table)


def _value_info(
    name: str, types: Mapping[str, onnx.ValueInfoProto], table: ShapeTable
) -> onnx.ValueInfoProto:
    known = types.get(name)
    if known is not None and _typed(known):
        info = onnx.ValueInfoProto()
        info.CopyFrom(known)
        return info
    shape = table.shapes.get(name)
    if shape is None:
        raise GraphError(f"no type is known for segment boundary tensor {name!r}")
    return onnx.helper.make_tensor_value_info(name, shape.elem_type, None)


def _typed(info: onnx.ValueInfoProto) -> bool:
    """Whether ``info`` names a type: a non-tensor type, or a tensor with an element type."""
    kind = info.type.WhichOneof("value")
    return kind is not None and (kind != "tensor_type" or info.type.tensor_type.elem_type != 0)
