"""fp16 weights for a decoder: ONNX Runtime's own converter, with the graph's inputs and outputs
kept float32 (the KV cache and the frames between agents stay float32), and the converter's
boundary casts moved next to where they are used so the graph still cuts between layers."""

from __future__ import annotations

import onnx


def fp16_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with float16 weights and float32 inputs and outputs (see the module doc)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted: onnx.ModelProto = convert_float_to_float16(
        model, keep_io_types=True, disable_shape_infer=True
    )
    _casts_next_to_use(converted.graph)
    return converted


def _casts_next_to_use(graph: onnx.GraphProto) -> None:
    """Move each ``Cast`` of a graph input to just before its first reader, and each ``Cast``
    to a graph output to just after the node making its input.

    The converter puts the input casts first and the output casts last, so in file order
    every layer's past key/value would be read at the start and its present made at the end:
    a cut between layers would separate each layer's cache from its stage.
    """
    casts, before, after = _io_casts(graph)
    ordered: list[onnx.NodeProto] = []

    def emit(node: onnx.NodeProto) -> None:
        for name in node.input:
            if name in before:
                ordered.append(before.pop(name))
        ordered.append(node)
        for out in node.output:
            for cast in after.pop(out, []):
                emit(cast)

    for node in graph.node:
        if not node.output or node.output[0] not in casts:
            emit(node)
    ordered.extend([*before.values(), *(c for cs in after.values() for c in cs)])
    graph.ClearField("node")
    graph.node.extend(ordered)


def _io_casts(
    graph: onnx.GraphProto,
) -> tuple[set[str], dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """The casts of graph inputs and to graph outputs (by the tensor each makes, unique in a
    graph), the input casts by what they make, and the output casts by what they read."""
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    casts = [
        n
        for n in graph.node
        if n.op_type == "Cast" and (n.input[0] in inputs or n.output[0] in outputs)
    ]
    before = {n.output[0]: n for n in casts if n.input[0] in inputs}
    after: dict[str, list[onnx.NodeProto]] = {}
    for node in casts:
        if node.input[0] not in inputs:
            after.setdefault(node.input[0], []).append(node)
    return {n.output[0] for n in casts}, before, after
