"""A draft model's lean output head (``partitioner.models.decoders.draft_head``) on hand-built
graphs, float32 and int4: the cut graph ranks exactly the kept tokens the full graph scores, and
returns their token ids."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner.errors import GraphError
from partitioner.models.decoders.draft_head import kept_ids, lean_head

K, N, TOP = 64, 96, 5


def head_model(seed: int = 0) -> onnx.ModelProto:
    """``x [rows, K] @ W [K, N]``, ranked by two TopKs: every row's, and the last row's (a
    decoder's ``top_*`` and ``trailing_top_*`` outputs, through a ``Slice`` and a ``Gather``)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((K, N)).astype(np.float32)
    k = numpy_helper.from_array(np.asarray([TOP], np.int64), "k")
    last = numpy_helper.from_array(np.asarray(-1, np.int64), "last")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["scores"], name="head"),
        helper.make_node("TopK", ["scores", "k"], ["trailing_logits", "trailing_ids"], name="t1"),
        helper.make_node("Gather", ["scores", "last"], ["last_scores"], axis=0, name="pick"),
        helper.make_node("TopK", ["last_scores", "k"], ["top_logits", "top_ids"], name="t2"),
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])],
        [
            helper.make_tensor_value_info("top_logits", TensorProto.FLOAT, [TOP]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, [TOP]),
            helper.make_tensor_value_info("trailing_logits", TensorProto.FLOAT, ["rows", TOP]),
            helper.make_tensor_value_info("trailing_ids", TensorProto.INT64, ["rows", TOP]),
        ],
        [numpy_helper.from_array(weight, "w"), k, last],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def int4(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=False)
    quantizer.process()
    quantized: onnx.ModelProto = quantizer.model.model
    return quantized


def run(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {"x": x}), strict=True))


def full_scores(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """Every token's score of ``model``, read from its head by a TopK over all ``N``."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for node in probe.graph.node:
        if node.op_type == "TopK":
            probe.graph.initializer.append(
                numpy_helper.from_array(np.asarray([N], np.int64), f"all_{node.name}")
            )
            node.input[1] = f"all_{node.name}"
    out = run(probe, x)
    scores = np.empty((x.shape[0], N), np.float32)
    np.put_along_axis(scores, out["trailing_ids"], out["trailing_logits"], axis=1)
    return scores


@pytest.mark.parametrize("precision", ["fp32", "int4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_lean_head_ranks_the_kept_tokens_as_the_whole_head_scores_them(
    precision: str, seed: int
) -> None:
    rng = np.random.default_rng(100 + seed)
    keep = np.sort(rng.choice(N, size=int(rng.integers(TOP, N)), replace=False))
    whole = head_model(seed) if precision == "fp32" else int4(head_model(seed))
    x = rng.standard_normal((3, K)).astype(np.float32)
    scores = full_scores(whole, x)[:, keep]
    lean = onnx.ModelProto()
    lean.CopyFrom(whole)
    out = run(lean_head(lean, [int(i) for i in keep]), x)
    best = np.argsort(-scores, axis=1, kind="stable")[:, :TOP]
    np.testing.assert_array_equal(out["trailing_ids"], keep[best])
    np.testing.assert_allclose(
        out["trailing_logits"], np.take_along_axis(scores, best, axis=1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(out["top_ids"], keep[best[-1]])
    head = next(n for n in lean.graph.node if n.op_type in ("MatMul", "MatMulNBits"))
    widths = [a.i for a in head.attribute if a.name == "N"]
    assert widths == ([] if precision == "fp32" else [len(keep)])


def test_the_cut_head_drops_the_whole_weight() -> None:
    model = lean_head(int4(head_model()), list(range(40)))
    sizes = {t.name: t.dims[0] for t in model.graph.initializer if len(t.dims) > 1}
    assert sizes and all(rows == 40 for rows in sizes.values())


def test_kept_ids_are_the_first_ids_and_the_special_ones() -> None:
    assert kept_ids(10, [9, 2, 42, -1], 4) == [0, 1, 2, 3, 9]
    assert kept_ids(3, [], 8) == [0, 1, 2]
    with pytest.raises(GraphError, match="at least one"):
        kept_ids(10, [], 0)


def test_a_graph_without_a_head_to_cut_is_refused() -> None:
    with pytest.raises(GraphError, match="cuts nothing"):
        lean_head(head_model(), list(range(N)))
    model = head_model()
    model.graph.node.remove(model.graph.node[0])  # the scores become a dangling input
    with pytest.raises(GraphError, match="not an output head"):
        lean_head(model, [0, 1, 2, 3, 4, 5])
    no_topk = head_model()
    for node in [n for n in no_topk.graph.node if n.op_type == "TopK"]:
        no_topk.graph.node.remove(node)
    with pytest.raises(GraphError, match="no TopK"):
        lean_head(no_topk, [0, 1])
