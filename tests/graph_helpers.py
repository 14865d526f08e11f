"""Small ONNX graphs built with ``onnx.helper`` (no torch) for the partitioner's unit tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from partitioner.analysis.frontier import Frontier
from partitioner.analysis.graph import GraphIndex
from partitioner.cutting.inputs import Analysis
from partitioner.cutting.segments import plan_segments
from partitioner.cutting.split import write_segments
from partitioner.cutting.verify import run_chain, run_model

OPSET = [helper.make_opsetid("", 17)]
HIDDEN = 8
VOCAB = 200


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def kitchen_sink(blocks: int = 4, seed: int = 0) -> onnx.ModelProto:
    """Residual blocks with everything a cut must respect.

    - ``ids`` index a table ``E`` that is tied to the output projection (``Transpose(E)``);
    - every block adds ``relu(h @ W_i) * c`` back into ``h`` (a residual) with ``c`` a
      ``Constant`` node shared by all blocks;
    - ``early`` is a model output made after the first block;
    - ``bias`` is a model input used only at the end;
    - the end reshapes to ``Shape(embedding)``, a shape leaf whose activation is long dead.
    """
    rng = np.random.default_rng(seed)
    inits = [_init("E", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))]
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["h0"]),
        helper.make_node("Shape", ["h0"], ["shape0"]),
        helper.make_node(
            "Constant", [], ["c"], value=helper.make_tensor("cv", TensorProto.FLOAT, [], [0.5])
        ),
    ]
    for i in range(blocks):
        inits.append(_init(f"W{i}", rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)))
        nodes += [
            helper.make_node("MatMul", [f"h{i}", f"W{i}"], [f"m{i}"]),
            helper.make_node("Relu", [f"m{i}"], [f"r{i}"]),
            helper.make_node("Mul", [f"r{i}", "c"], [f"s{i}"]),
            helper.make_node("Add", [f"h{i}", f"s{i}"], [f"h{i + 1}"]),
        ]
        if i == 0:
            nodes.append(helper.make_node("Identity", ["h1"], ["early"]))
    nodes += [
        helper.make_node("Add", [f"h{blocks}", "bias"], ["hb"]),
        helper.make_node("Reshape", ["hb", "shape0"], ["rs"]),
        helper.make_node("Transpose", ["E"], ["ET"]),
        helper.make_node("MatMul", ["rs", "ET"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "kitchen_sink",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [HIDDEN]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", VOCAB]),
            helper.make_tensor_value_info("early", TensorProto.FLOAT, ["n", HIDDEN]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def kitchen_feeds(n: int = 5, seed: int = 1) -> dict[str, np.ndarray]:
    """Inputs for :func:`kitchen_sink`."""
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(0, VOCAB, size=n).astype(np.int64),
        "bias": rng.standard_normal(HIDDEN).astype(np.float32),
    }


def block_stack(blocks: int, width: int = 64, seed: int = 0) -> onnx.ModelProto:
    """A plain residual MLP stack: ``h += gelu-ish(h @ A_i) @ B_i`` per block."""
    rng = np.random.default_rng(seed)
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    for i in range(blocks):
        a = rng.standard_normal((width, 2 * width)).astype(np.float32) / width
        b = rng.standard_normal((2 * width, width)).astype(np.float32) / width
        inits += [_init(f"A{i}", a), _init(f"B{i}", b)]
        nodes += [
            helper.make_node("MatMul", [f"x{i}", f"A{i}"], [f"u{i}"]),
            helper.make_node("Tanh", [f"u{i}"], [f"t{i}"]),
            helper.make_node("MatMul", [f"t{i}", f"B{i}"], [f"v{i}"]),
            helper.make_node("Add", [f"x{i}", f"v{i}"], [f"x{i + 1}"]),
        ]
    graph = helper.make_graph(
        nodes,
        "block_stack",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(f"x{blocks}", TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def chain_outputs(
    analysis: Analysis, cuts: Sequence[int], out_dir: Path, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Write segments for ``cuts`` and run them as a chain."""
    written = write_segments(analysis, cuts, out_dir)
    return run_chain([w.files[0] for w in written], feeds)


def whole_outputs(
    model: onnx.ModelProto, path: Path, feeds: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Save ``model`` to ``path`` and run it."""
    onnx.save(model, str(path))
    return run_model(path, feeds)


def specs_for(index: GraphIndex, frontier: Frontier, cuts: Sequence[int]) -> list[object]:
    """Segment specs (for inspection) of explicit cuts."""
    return list(plan_segments(index, frontier, cuts))


def main_position(analysis: Analysis, output: str, frontier: Frontier | None = None) -> int:
    """Position in the main order of the node producing ``output``."""
    node = analysis.index.producer[output]
    return (frontier or analysis.frontier).position[node]


def kv_stack(layers: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A decoder-like stack with a per-layer cache: ``past_i`` in, ``present_i`` out."""
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    nodes: list[onnx.NodeProto] = []
    inits = [_init("axis0", np.array([0], np.int64))]
    inputs = [helper.make_tensor_value_info("h0", f32, ["n", HIDDEN])]
    outputs = []
    for i in range(layers):
        inits.append(_init(f"W{i}", rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)))
        inputs.append(helper.make_tensor_value_info(f"past{i}", f32, ["p", HIDDEN]))
        outputs.append(helper.make_tensor_value_info(f"present{i}", f32, ["q", HIDDEN]))
        nodes += [
            helper.make_node("Concat", [f"past{i}", f"h{i}"], [f"present{i}"], axis=0),
            helper.make_node("ReduceSum", [f"present{i}", "axis0"], [f"r{i}"], keepdims=1),
            helper.make_node("MatMul", [f"h{i}", f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"r{i}"], [f"h{i + 1}"]),
        ]
    outputs.insert(0, helper.make_tensor_value_info(f"h{layers}", f32, ["n", HIDDEN]))
    graph = helper.make_graph(nodes, "kv_stack", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=OPSET)


def kv_feeds(layers: int = 4, n: int = 3, past: int = 5) -> dict[str, np.ndarray]:
    """Inputs for :func:`kv_stack`."""
    rng = np.random.default_rng(7)
    feeds = {"h0": rng.standard_normal((n, HIDDEN)).astype(np.float32)}
    for i in range(layers):
        feeds[f"past{i}"] = rng.standard_normal((past, HIDDEN)).astype(np.float32)
    return feeds


def token_decoder(layers: int = 4, vocab: int = 5000, seed: int = 0) -> onnx.ModelProto:
    """A decoder with the shape of :mod:`protocols.decoder`'s contract, built from plain ops.

    ``input_ids`` index a large table ``E`` (tied to the output head); a mask term and a
    position term are computed once from ``attention_mask`` and ``position_ids`` and read by
    every layer; layer ``i`` appends ``h @ K_i`` (as ``[1, 2, q, 4]``) to ``past.i.key`` and
    adds a summary of the grown cache back into ``h``. Outputs ``logits`` and the presents.
    """
    rng = np.random.default_rng(seed)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inits = [
        _init("E", rng.standard_normal((vocab, HIDDEN)).astype(np.float32)),
        _init("kv_shape", np.array([1, -1, 2, 4], np.int64)),
        _init("sum_shape", np.array([1, 1, HIDDEN], np.int64)),
        _init("inv_freq", np.linspace(0.1, 1.0, HIDDEN).astype(np.float32)),
        _init("last", np.array([-1], np.int64)),
        _init("one", np.array([1], np.int64)),
        _init("axis1", np.array([1], np.int64)),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [1, "q"]),
        helper.make_tensor_value_info("attention_mask", i64, [1, "kv"]),
        helper.make_tensor_value_info("position_ids", i64, [1, "q"]),
    ]
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["h0"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=f32),
        helper.make_node("ReduceMean", ["mask_f"], ["mask_term"], keepdims=0),
        helper.make_node("Cast", ["position_ids"], ["pos_f"], to=f32),
        helper.make_node("Unsqueeze", ["pos_f", "last"], ["pos_col"]),
        helper.make_node("Mul", ["pos_col", "inv_freq"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["rope"]),
    ]
    outputs = []
    for i in range(layers):
        inits.append(_init(f"K{i}", rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)))
        inputs.append(helper.make_tensor_value_info(f"past.{i}.key", f32, [1, 2, "past", 4]))
        outputs.append(helper.make_tensor_value_info(f"present.{i}.key", f32, [1, 2, "kv", 4]))
        nodes += [
            helper.make_node("Mul", [f"h{i}", "rope"], [f"hr{i}"]),
            helper.make_node("MatMul", [f"hr{i}", f"K{i}"], [f"k{i}"]),
            helper.make_node("Reshape", [f"k{i}", "kv_shape"], [f"k4_{i}"]),
            helper.make_node("Transpose", [f"k4_{i}"], [f"kt{i}"], perm=[0, 2, 1, 3]),
            helper.make_node("Concat", [f"past.{i}.key", f"kt{i}"], [f"present.{i}.key"], axis=2),
            helper.make_node("ReduceMean", [f"present.{i}.key"], [f"r{i}"], axes=[2], keepdims=1),
            helper.make_node("Reshape", [f"r{i}", "sum_shape"], [f"rs{i}"]),
            helper.make_node("Tanh", [f"rs{i}"], [f"t{i}"]),
            helper.make_node("Add", [f"h{i}", f"t{i}"], [f"a{i}"]),
            helper.make_node("Add", [f"a{i}", "mask_term"], [f"h{i + 1}"]),
        ]
    nodes += [
        helper.make_node("Gather", [f"h{layers}", "last"], ["h_last"], axis=1),
        helper.make_node("Transpose", ["E"], ["ET"]),
        helper.make_node("MatMul", ["h_last", "ET"], ["logits"]),
    ]
    outputs.insert(0, helper.make_tensor_value_info("logits", f32, [1, 1, vocab]))
    graph = helper.make_graph(nodes, "token_decoder", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=OPSET)


def token_decoder_feeds(layers: int = 4, q: int = 3, past: int = 5) -> dict[str, np.ndarray]:
    """Inputs for :func:`token_decoder`: ``q`` new tokens after ``past`` cached ones."""
    rng = np.random.default_rng(3)
    feeds = {
        "input_ids": rng.integers(0, 100, (1, q)).astype(np.int64),
        "attention_mask": np.ones((1, past + q), np.int64),
        "position_ids": np.arange(past, past + q, dtype=np.int64)[None, :],
    }
    for i in range(layers):
        feeds[f"past.{i}.key"] = rng.standard_normal((1, 2, past, 4)).astype(np.float32)
    return feeds
