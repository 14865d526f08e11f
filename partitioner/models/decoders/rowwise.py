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

``MatMulNBits`` itself is row-exact only where ONNX Runtime's kernel for the CPU makes it so: on
AVX-512 it computes one row as it computes several, but its AVX2 kernel runs a one-row product
through a kernel of its own. :func:`rows_decode_alike` therefore checks the exported graph on
the machine that exports it, and the export marks the graph as coupled when it is not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from partitioner.errors import GraphError
from partitioner.models.decoders.ort_runner import OrtDecoder
from protocols.decoder import DECODER_FILE, DECODER_METADATA_KEY, MODEL_FILE, DecoderInfo

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
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise GraphError(f"two-row products need opset {MIN_OPSET} or newer; the model has {opset}")
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        nodes.extend(_padded(node) if node.op_type == "MatMul" and not node.domain else [node])
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


PROBE_IDS = (1, 17, 301, 45, 9, 230, 77)
"""Token ids :func:`rows_decode_alike` decodes (inside every exported vocabulary)."""


def rows_decode_alike(export_dir: Path) -> bool:
    """Whether the decoder export in ``export_dir``, in one ONNX Runtime session on this
    machine, gives a token's candidates bit for bit alike in a one-token step and in a pass
    that also runs the token before it (what a speculative verify pass does)."""
    decoder = OrtDecoder(export_dir, threads=1)
    ids = list(PROBE_IDS)
    decoder.prefill(ids[:-2])
    decoder.step(ids[-2:-1])
    alone = decoder.step(ids[-1:])
    decoder.prefill(ids[:-2])
    together = decoder.step(ids[-2:])
    return bool(
        np.array_equal(alone.top_logits, together.top_logits)
        and np.array_equal(alone.top_ids, together.top_ids)
    )


def coupled_info_json(info_json: str) -> str:
    """A ``decoder.json`` document marked ``rows_independent: false``."""
    info = DecoderInfo.from_json(info_json.encode())
    return info.model_copy(update={"rows_independent": False}).to_json()


def mark_rows_coupled(export_dir: Path) -> None:
    """Mark the export in ``export_dir`` ``rows_independent: false``, in its ``decoder.json``
    and in its model's own copy (the weights, inline or external, are written unchanged)."""
    info_file = export_dir / DECODER_FILE
    info_file.write_text(coupled_info_json(info_file.read_text()) + "\n")
    model_file = export_dir / MODEL_FILE
    model = onnx.load(str(model_file), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == DECODER_METADATA_KEY:
            prop.value = coupled_info_json(prop.value)
    onnx.save(model, str(model_file))
