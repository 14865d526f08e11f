"""Float products that compute each row the same in a pass of any number of rows.

ONNX Runtime's float32 ``MatMul`` runs a one-row left operand through a matrix-vector kernel
and two rows or more through its GEMM kernel. The two add in different orders, so a token's
attention scores differ in the last bits between a one-token decode step and a pass that
verifies several drafted tokens (about 1e-5 on a 1 x 128 by 128 x T product; from two rows up
every row is bit-for-bit the same, whatever the row count). An int4 decoder's ``MatMulNBits``
at ``accuracy_level`` 4 quantizes its activations to int8 per row and block, and a last-bit
difference that moves one of those roundings grows to whole hundredths in the logits (Qwen
1.5B: a token's top logit 0.067 apart alone and in a two-token pass), so speculative decoding
would not decode as plain steps do.

:func:`two_row_products` rewrites every float ``MatMul`` left in such a graph (the attention's
query-key and probability-value products; the weight products are ``MatMulNBits``, which
already compute each row alike) to run on its left operand stacked twice along the row axis and
keep the first half of the result: a one-row step then goes through the same kernel as a pass
of several rows. The products it pads are the attention's, a few MFLOP a token against the
weights' GFLOP.

Float graphs (fp32, fp16) have the same trouble in every product, the weights' included: a
one-row ``MatMul`` differs from the same row in a pass of several (tiny-llama float32: up to
5e-6 in a logit, 4e-6 in the keys and values; float16's kernel by whole steps of its last
place, enough to reorder near-tied candidates). :func:`at_least_two_rows` pads them without
doubling a pass: a one-row left operand is stacked twice, one of two rows or more runs as it
is. A step costs one extra row of every product (no difference measured on Gemma 3 270M
float32, whose decode step reads 1 GB of weights), a prefill or a verify pass nothing.
:func:`without_row_padding` undoes it where a float32 export is converted to another precision.

``MatMulNBits`` itself is row-exact only where ONNX Runtime's kernel for the CPU makes it so: on
AVX-512 it computes one row as it computes several, but its AVX2 kernel runs a one-row product
through a kernel of its own. :func:`rows_decode_alike` therefore checks every exported graph,
in every precision, on the machine that exports it (passes of every length a verify pass may
have, against one-token steps, bit for bit), and the export records the verdict
(``rows_independent``, ``rows_probed``): the coordinator speculates only on a graph that passed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from partitioner.errors import GraphError
from partitioner.models.decoders.ort_runner import OrtDecoder
from protocols.decoder import (
    DECODER_FILE,
    DECODER_METADATA_KEY,
    MODEL_FILE,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    DecoderInfo,
)

MIN_OPSET = 15
"""``Shape`` with ``start``/``end`` (the row count of the left operand) needs opset 15."""
PADDED_SUFFIX = "/two_rows"
"""Suffix of the names of the nodes and tensors :func:`two_row_products` adds."""


def two_row_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ``MatMul`` computed on at least two rows (see the module docstring).

    Each ``MatMul(a, b) -> y`` becomes ``Concat(a, a)`` along axis -2, the product, and a
    ``Slice`` of the first ``shape(a)[-2]`` rows into ``y``; graph inputs, outputs and every
    other node are kept in order. ``model`` is modified and returned. :class:`GraphError` if
    the default opset is older than :data:`MIN_OPSET`.
    """
    _check_opset(model)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        pad = node.op_type == "MatMul" and not node.domain and not _already_padded(node)
        nodes.extend(_padded(node) if pad else [node])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _padded(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes computing ``node``'s product on its left operand stacked twice."""
    left, right = node.input
    (out,) = node.output
    base = (node.name or out) + PADDED_SUFFIX
    stacked, product, rows = f"{base}/stacked", f"{base}/product", f"{base}/rows"
    starts, axes = f"{base}/starts", f"{base}/axes"
    return [
        helper.make_node("Concat", [left, left], [stacked], name=f"{base}/concat", axis=-2),
        helper.make_node("MatMul", [stacked, right], [product], name=f"{base}/matmul"),
        helper.make_node("Shape", [left], [rows], name=f"{base}/shape", start=-2, end=-1),
        helper.make_node("Constant", [], [starts], name=f"{base}/starts", value_ints=[0]),
        helper.make_node("Constant", [], [axes], name=f"{base}/axes", value_ints=[-2]),
        helper.make_node("Slice", [product, starts, rows, axes], [out], name=f"{base}/slice"),
    ]


AT_LEAST_TWO_SUFFIX = "/at_least_two_rows"
"""Suffix of the names of the nodes and tensors :func:`at_least_two_rows` adds."""


def at_least_two_rows(model: onnx.ModelProto, *, weight_products: bool) -> onnx.ModelProto:
    """``model`` with its float ``MatMul`` nodes computed on at least two rows, a pass of two
    rows or more left as it is (a float graph's construction, see the module docstring).

    A one-row left operand is stacked twice, multiplied and the first row kept; a left operand
    of ``r >= 2`` rows is multiplied as is (the same nodes, which then copy it). So a one-row
    step runs the kernel a pass of several rows runs, at the cost of one extra row in a decode
    step and none in a prefill or a verify pass (:func:`two_row_products` doubles every pass).
    ``weight_products``: also the products whose right operand is an initializer (the weights);
    else only those of two computed operands (the attention's). Products already padded by this
    function or :func:`two_row_products` are kept. ``model`` is modified and returned.
    :class:`GraphError` if the default opset is older than :data:`MIN_OPSET`.
    """
    _check_opset(model)
    constant = {t.name for t in model.graph.initializer} | {
        o for n in model.graph.node if n.op_type == "Constant" for o in n.output
    }
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        pad = (
            node.op_type == "MatMul"
            and not node.domain
            and not _already_padded(node)
            and (weight_products or node.input[1] not in constant)
        )
        nodes.extend(_at_least_two(node) if pad else [node])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def without_row_padding(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the products :func:`at_least_two_rows` padded back to plain ``MatMul``
    nodes (what a conversion to another precision starts from: its own construction differs).

    Each padded product's nodes are replaced by one ``MatMul`` of its original operands and
    output, named as before, where its padded product was. ``model`` is modified and returned.
    """
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        base, found, _ = node.name.rpartition(AT_LEAST_TWO_SUFFIX + "/")
        if found:
            groups.setdefault(base, []).append(node)
    if not groups:
        return model
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        base, found, part = node.name.rpartition(AT_LEAST_TWO_SUFFIX + "/")
        if not found:
            nodes.append(node)
        elif part == "matmul":
            nodes.append(_plain(base, groups[base]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _plain(base: str, group: list[onnx.NodeProto]) -> onnx.NodeProto:
    """The ``MatMul`` that :func:`_at_least_two` made ``group`` of."""
    parts = {n.name.rpartition("/")[2]: n for n in group}
    if not {"concat", "matmul", "slice"} <= parts.keys():
        raise GraphError(f"{base}: padded product without its concat, matmul and slice")
    left, right = parts["concat"].input[0], parts["matmul"].input[1]
    return helper.make_node("MatMul", [left, right], [parts["slice"].output[0]], name=base)


def _already_padded(node: onnx.NodeProto) -> bool:
    return node.name.endswith((f"{PADDED_SUFFIX}/matmul", f"{AT_LEAST_TWO_SUFFIX}/matmul"))


def _at_least_two(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes computing ``node``'s product on ``max(rows, 2)`` rows of its left operand."""
    left, right = node.input
    (out,) = node.output
    b = (node.name or out) + AT_LEAST_TWO_SUFFIX
    mk = helper.make_node
    return [
        mk("Concat", [left, left], [f"{b}/stacked"], name=f"{b}/concat", axis=-2),
        mk("Shape", [left], [f"{b}/rows"], name=f"{b}/shape", start=-2, end=-1),
        mk("Constant", [], [f"{b}/two"], name=f"{b}/two", value_ints=[2]),
        mk("Max", [f"{b}/rows", f"{b}/two"], [f"{b}/taken"], name=f"{b}/taken"),
        mk("Constant", [], [f"{b}/starts"], name=f"{b}/starts", value_ints=[0]),
        mk("Constant", [], [f"{b}/axes"], name=f"{b}/axes", value_ints=[-2]),
        mk("Slice", [f"{b}/stacked", f"{b}/starts", f"{b}/taken", f"{b}/axes"], [f"{b}/left"],
           name=f"{b}/left"),
        mk("MatMul", [f"{b}/left", right], [f"{b}/product"], name=f"{b}/matmul"),
        mk("Slice", [f"{b}/product", f"{b}/starts", f"{b}/rows", f"{b}/axes"], [out],
           name=f"{b}/slice"),
    ]  # fmt: skip


def _check_opset(model: onnx.ModelProto) -> None:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise GraphError(f"two-row products need opset {MIN_OPSET} or newer; the model has {opset}")


PROBE_PROMPT = (1, 17, 301, 45, 9)
"""Token ids :func:`rows_decode_alike` reads first (inside every exported vocabulary)."""
PROBE_TOKENS = (230, 77, 5, 1000, 2000, 31, 8, 99)
"""Token ids it then feeds one a step and in passes of every length (the most a verify pass
carries is the graph's ``trailing_positions``, 8 in exports)."""

Outputs = dict[str, np.ndarray]


def rows_decode_alike(export_dir: Path) -> bool:
    """Whether the decoder export in ``export_dir``, in one ONNX Runtime session on this
    machine, decodes a pass of ``m`` tokens as ``m`` one-token steps, bit for bit, for every
    ``m`` from 2 to its ``trailing_positions`` (what a speculative verify pass must): each
    position's candidates the pass returns, and every position's keys and values."""
    decoder = OrtDecoder(export_dir, threads=1)
    width = min(max(decoder.info.trailing_positions or 1, 2), len(PROBE_TOKENS))
    tokens = list(PROBE_TOKENS[:width])
    decoder.prefill(list(PROBE_PROMPT))
    steps = [decoder.run_step([token]) for token in tokens]
    for count in range(2, width + 1):
        decoder.prefill(list(PROBE_PROMPT))
        together = decoder.run_step(tokens[:count])
        if not _pass_matches(decoder.info, together, steps[:count]):
            return False
    return True


def _pass_matches(info: DecoderInfo, together: Outputs, steps: list[Outputs]) -> bool:
    """Whether a pass's outputs (``together``) equal those of the one-token ``steps``."""
    if TRAILING_TOP_LOGITS in together:
        logits, ids = together[TRAILING_TOP_LOGITS][0], together[TRAILING_TOP_IDS][0]
    else:
        logits, ids = together[TOP_LOGITS], together[TOP_IDS]
    alike = all(
        np.array_equal(logits[-back], step[TOP_LOGITS][0])
        and np.array_equal(ids[-back], step[TOP_IDS][0])
        for back, step in zip(range(len(logits), 0, -1), steps[-len(logits) :], strict=True)
    )
    for pair in info.state:
        present = together[pair.present]
        length = present.shape[pair.axis]
        tail = np.take(present, range(length - len(steps), length), axis=pair.axis)
        one_by_one = [np.take(s[pair.present], [-1], axis=pair.axis) for s in steps]
        alike = alike and np.array_equal(tail, np.concatenate(one_by_one, axis=pair.axis))
    return alike


def probed_info_json(info_json: str, alike: bool) -> str:
    """A ``decoder.json`` document recording the probe's verdict ``alike``
    (``rows_independent``, and ``rows_probed: true``)."""
    info = DecoderInfo.from_json(info_json.encode())
    return info.model_copy(update={"rows_independent": alike, "rows_probed": True}).to_json()


def record_rows(export_dir: Path, alike: bool) -> None:
    """Record the probe's verdict ``alike`` on the export in ``export_dir``, in its
    ``decoder.json`` and in its model's own copy (the weights, inline or external, are written
    unchanged)."""
    info_file = export_dir / DECODER_FILE
    info_file.write_text(probed_info_json(info_file.read_text(), alike) + "\n")
    model_file = export_dir / MODEL_FILE
    model = onnx.load(str(model_file), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == DECODER_METADATA_KEY:
            prop.value = probed_info_json(prop.value, alike)
    onnx.save(model, str(model_file))


def probe_rows(export_dir: Path) -> bool:
    """Probe the export in ``export_dir`` (:func:`rows_decode_alike`) and record the verdict
    (:func:`record_rows`); the verdict."""
    alike = rows_decode_alike(export_dir)
    record_rows(export_dir, alike)
    return alike


def mark_rows_coupled(export_dir: Path) -> None:
    """Mark the export in ``export_dir`` ``rows_independent: false`` (see :func:`record_rows`)."""
    record_rows(export_dir, False)
