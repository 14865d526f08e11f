"""ONNX Runtime's weight quantizers as the export runs them: ``ModelProto`` in, ``ModelProto``
out (:mod:`partitioner.models.decoders.precision` picks them per precision and records the result).

- :func:`nbits`: ``MatMulNBitsQuantizer`` (4-bit blocks at :data:`ACCURACY_LEVEL`);
- :func:`dynamic_int8`: ``quantize_dynamic`` (int8 weights per output channel, 7-bit range:
  :data:`INT8_REDUCE_RANGE`), then :func:`per_row_int8` so each row of a pass is computed as a
  pass of one computes it;
- :func:`fold_weight_transposes` first, so a tied head's transposed weight is quantized too.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx

from partitioner.models.decoders.int8rows import per_row_activations
from partitioner.models.decoders.rowwise import two_row_products
from protocols.decoder import MODEL_FILE

ACCURACY_LEVEL = 4
"""``MatMulNBits``' ``accuracy_level``: 4 multiplies int8 activations (quantized per row and
block inside the kernel) by the 4-bit weights, where 0 unpacks every weight to float32 first.
Measured on a 1536 x 8960 Qwen weight, one thread: one row 0.39 ms against 1.10-1.18 (a scratch
script) and 0.65 ms against 1.45 (``bench/verify_rows.py``), what a decode step runs; four rows
0.87-0.90 ms against 3.77-3.80. On AVX-512 its rows are computed bit for bit alike in passes of
any size (ONNX Runtime 1.32; the float products around it are padded for that, see
:mod:`partitioner.models.decoders.rowwise`); the export's probe
(:func:`~partitioner.models.decoders.rowwise.rows_decode_alike`) covers the CPUs where they are
not."""
INT8_REDUCE_RANGE = True
"""int8 weights use 7 of their 8 bits (``quantize_dynamic(reduce_range=True)``, ONNX Runtime's
documented remedy for saturation). On x86 CPUs without VNNI (AVX2 only: AMD Zen 2, older Intel)
its u8s8 ``MatMulInteger`` kernel adds pairs of products in 16 bits (``VPMADDUBSW``), which
saturate with full-range weights. Gemma 3 270M, 128 tokens: full range scored perplexity 143
(fp32 20.1) and 34% top-1 agreement on an AVX2-only AMD EPYC, against 20.08 and 90.6% on a
CPU with VNNI; 7-bit weights score 20.85 and 87.5% on the AVX2-only one (u8u8 weights: 20.60
and 82.8%)."""


def fold_weight_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Store ``MatMul(x, Transpose(W))`` of an initializer ``W`` as ``MatMul(x, W_t)``.

    A tied output head reads the word embedding that way, and ONNX Runtime's weight
    quantizers only quantize a ``MatMul`` whose weight is an initializer: without this the
    head would stay float32 (for Gemma 3 270M, 640 MiB of its 1 GiB). The embedding and the
    head then each get their own quantized table. ``model`` is modified and returned.
    """
    from onnx import numpy_helper

    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    folded: list[onnx.NodeProto] = []
    for node in graph.node:
        users = readers.get(node.output[0], []) if node.op_type == "Transpose" else []
        source = weights.get(node.input[0]) if users else None
        if source is None or any(
            u.op_type != "MatMul" or u.input[0] == node.output[0] for u in users
        ):
            continue
        perm = [a.ints for a in node.attribute if a.name == "perm"]
        array = numpy_helper.to_array(source)
        transposed = array.transpose(list(perm[0]) if perm else None)
        graph.initializer.append(numpy_helper.from_array(transposed, node.output[0]))
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    return model


def nbits(
    model: onnx.ModelProto, bits: int, ops: tuple[str, ...], block_size: int
) -> onnx.ModelProto:
    """``MatMulNBitsQuantizer``: ``ops``' weights in ``bits``-bit blocks of ``block_size``
    with zero points, ``MatMul`` quantized along its input axis, ``Gather`` along its rows."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size,
        is_symmetric=False,
        accuracy_level=ACCURACY_LEVEL,
        op_types_to_quantize=ops,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer.process()
    result: onnx.ModelProto = quantizer.model.model
    return result


def dynamic_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """``quantize_dynamic``: int8 weights per output channel for every ``MatMul``
    (``MatMulInteger`` on activations quantized at run time) and the embedding ``Gather``."""
    with tempfile.TemporaryDirectory(prefix="fedshard-int8-") as tmp:
        source, out = Path(tmp) / "source.onnx", Path(tmp) / MODEL_FILE
        onnx.save_model(model, str(source), save_as_external_data=True)
        quantize_dynamic_file(source, out)
        return onnx.load(str(out), load_external_data=True)


def per_row_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """``quantize_dynamic``'s ``model`` computing each row of a pass as a pass of one does."""
    return two_row_products(per_row_activations(model))


def quantize_dynamic_file(source: Path, out: Path) -> None:
    """ONNX Runtime's ``quantize_dynamic`` of ``source`` into ``out`` (external data)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        source,
        out,
        op_types_to_quantize=["MatMul", "Gather"],
        per_channel=True,
        weight_type=QuantType.QInt8,
        reduce_range=INT8_REDUCE_RANGE,
        use_external_data_format=True,
    )


@contextmanager
def quiet_quantizer() -> Iterator[None]:
    """ONNX Runtime's quantizers log a warning per skipped node and numpy warns on all-zero
    blocks (they get scale 0 and stay zero); keep errors only while they run."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        logging.disable(previous)
