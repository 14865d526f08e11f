"""Weight precision of an exported decoder: fp32, fp16, int8 or int4, with ONNX Runtime's tools.

No quantizer is written here; each precision is one of ONNX Runtime's own:

- ``fp32``: the export's own graph, its products run on at least two rows
  (:func:`~partitioner.models.decoders.rowwise.at_least_two_rows`; the export applies it).
- ``fp16``: :func:`onnxruntime.transformers.float16.convert_float_to_float16` with the graph's
  inputs and outputs kept float32 (the KV cache and the frames between agents stay float32),
  its products then run on at least two rows, as float32's.
- ``int8``: :func:`onnxruntime.quantization.quantize_dynamic`, int8 weights per output
  channel in a 7-bit range
  (:data:`~partitioner.models.decoders.ort_quantizers.INT8_REDUCE_RANGE`): every ``MatMul``
  with a constant weight becomes ``MatMulInteger`` (activations quantized at run time), the
  embedding an int8 ``Gather`` followed by ``DequantizeLinear``. Its activations are then
  quantized per row rather than per pass
  (:func:`~partitioner.models.decoders.int8rows.per_row_activations`) and its float products
  run on two rows or more, so every row decodes alike in a pass of any size.
  (``MatMulNBits`` at 8 bits ran 5-6x slower than this on tiny-llama here, and slower than
  float32.)
- ``int4``: :class:`~onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`,
  4 bits, blocks of :data:`BLOCK_SIZE`, with zero points, ``accuracy_level``
  :data:`ACCURACY_LEVEL`: ``MatMul`` → ``MatMulNBits``, the embedding ``Gather`` →
  ``GatherBlockQuantized``; the float products left (attention) then run on two rows or more
  (:func:`~partitioner.models.decoders.rowwise.two_row_products`), so every row decodes alike in a
  pass of any size.

:func:`quantize_model` is ``ModelProto`` in, ``ModelProto`` out; :func:`quantize_decoder` is
the thin file layer over a ``fedshard.decoder/1`` directory (weights of models over 2 GB go to
external data). The precision is recorded in the model's metadata under
:data:`WEIGHTS_METADATA_KEY`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import onnx

from partitioner.analysis.modelio import initializer_bytes, save_model
from partitioner.errors import GraphError
from partitioner.models.decoders.fp16 import fp16_model
from partitioner.models.decoders.ort_quantizers import (
    ACCURACY_LEVEL,
    dynamic_int8,
    fold_weight_transposes,
    nbits,
    per_row_int8,
    quantize_dynamic_file,
    quiet_quantizer,
)
from partitioner.models.decoders.progress import Steps
from partitioner.models.decoders.rowwise import (
    at_least_two_rows,
    probe_rows,
    two_row_products,
    without_row_padding,
)
from partitioner.models.decoders.weights import WEIGHTS, Weights
from protocols.decoder import DECODER_FILE, DECODER_METADATA_KEY, MODEL_FILE, DecoderInfo

__all__ = ["WEIGHTS", "Weights", "default_weights", "parse_weights", "quantize_decoder"]

WEIGHTS_METADATA_KEY = "fedshard.weights"
"""Metadata key naming the precision a decoder's weights were stored in."""

BLOCK_SIZE = 32
"""Weights per quantization block along the reduced axis (one scale and zero point each)."""
SCHEME_METADATA_KEY = "fedshard.weights.scheme"
"""Metadata key naming how a quantized decoder's weights were stored (see :data:`SCHEMES`)."""


@dataclass(frozen=True)
class Int4Layout:
    """How int4 weights are stored: the served models' layout by default."""

    block_size: int = BLOCK_SIZE
    """Weights per scale and zero point."""
    two_rows: bool = True
    """Whether the float products run on two rows or more, so that every row decodes alike in
    a pass of any size (:func:`~partitioner.models.decoders.rowwise.two_row_products`; a draft
    model, whose proposals the served model checks, does without)."""

    @property
    def scheme(self) -> str:
        """Its :data:`SCHEMES` entry."""
        rows = ", two-row products" if self.two_rows else ""
        return f"MatMulNBits block {self.block_size}, accuracy_level {ACCURACY_LEVEL}{rows}"


SERVED_INT4 = Int4Layout()


FLOAT_ROWS = "MatMul on at least two rows"
"""How float32 and float16 graphs run their products (recorded in :data:`SCHEMES`)."""
SCHEMES: dict[Weights, str] = {
    "fp32": FLOAT_ROWS,
    "fp16": f"convert_float_to_float16, {FLOAT_ROWS}",
    "int8": "quantize_dynamic per-channel s8, 7-bit range, per-row activations, two-row products",
    "int4": SERVED_INT4.scheme,
}
"""The current storage scheme of each quantized precision: an export recorded under another
(or none: made before the scheme was recorded) is out of date and made again by the demo.

Every precision's row independence (see :attr:`protocols.decoder.DecoderInfo.rows_independent`)
rests on the graph rewrites above and on the CPU's kernels: the export checks the written graph
on its own machine (:func:`~partitioner.models.decoders.rowwise.rows_decode_alike`) and marks it
coupled when a token does not decode alike alone and in a verify pass. int4 is row-exact with
ONNX Runtime 1.32's
AVX-512 kernels, not with its AVX2 ones (one row runs through a kernel of its own there);
int8's integer products are exact on both (7-bit weights, no saturation). Both had coupled
their rows before their float products ran on two rows or more and int8's activations were
quantized per row (Qwen 1.5B int4: a token's top logit 0.067 apart alone and in a two-token
pass; Gemma 3 270M int8 with one activation scale per pass: see the README)."""

DEFAULT_WEIGHTS: dict[str, Weights] = {
    "gemma3-270m": "int8",
    "qwen2.5-coder-1.5b": "int4",
    "qwen2.5-coder-0.5b": "int4",
}
"""Per decoder front door, the precision ``fedshard export`` stores it in without
``--weights`` (chosen from the measured size and quality, see the README); float32 if absent."""


def default_weights(name: str) -> Weights:
    """The precision decoder ``name`` is exported in by default."""
    return DEFAULT_WEIGHTS.get(name, "fp32")


QUANTIZED_OPS = frozenset(
    {"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear", "MatMulInteger", "Cast"}
)
"""Operators a quantized decoder gains; :class:`Report` counts them."""


@dataclass(frozen=True)
class Report:
    """What one precision conversion produced."""

    weights: Weights
    source_bytes: int
    """Stored bytes of the source's weights (initializers)."""
    weight_bytes: int
    """Stored bytes of the converted weights, scales and zero points included."""
    operators: dict[str, int]
    """How many nodes of each of :data:`QUANTIZED_OPS` the converted graph has."""

    @property
    def ratio(self) -> float:
        """Converted size over source size."""
        return self.weight_bytes / max(1, self.source_bytes)


def parse_weights(value: str) -> Weights:
    """``value`` as a :data:`Weights`; :class:`GraphError` naming the choices otherwise."""
    for weights in WEIGHTS:
        if value == weights:
            return weights
    raise GraphError(f"unknown weight precision {value!r}; choose one of {', '.join(WEIGHTS)}")


def model_weights(model: onnx.ModelProto) -> Weights:
    """The precision recorded in ``model``'s metadata (``fp32`` when none is)."""
    for prop in model.metadata_props:
        if prop.key == WEIGHTS_METADATA_KEY:
            return parse_weights(prop.value)
    return "fp32"


def quantize_model(
    model: onnx.ModelProto, weights: Weights, layout: Int4Layout = SERVED_INT4
) -> onnx.ModelProto:
    """``model`` (float32, weights loaded) with its weights stored in ``weights``.

    The graph's inputs, outputs and metadata are kept; the result's metadata records the
    precision. ``layout``: how int4 is stored (a draft model's differs, see
    :mod:`partitioner.models.decoders.draft_head`). ``model`` itself may be modified.
    """
    weights = parse_weights(weights)
    metadata = _float_metadata(model)
    model = without_row_padding(model)
    with quiet_quantizer():
        if weights == "fp16":
            result = at_least_two_rows(fp16_model(model), weight_products=True)
        elif weights == "int8":
            result = per_row_int8(dynamic_int8(fold_weight_transposes(model)))
        elif weights == "int4":
            ops = ("MatMul", "Gather")
            result = nbits(fold_weight_transposes(model), 4, ops, layout.block_size)
            result = two_row_products(result) if layout.two_rows else result
        else:
            result = at_least_two_rows(model, weight_products=True)
    scheme = layout.scheme if weights == "int4" else SCHEMES.get(weights)
    return _record_precision(result, metadata, weights, scheme)


def _float_metadata(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """``model``'s metadata; :class:`GraphError` unless its weights are float32."""
    if model_weights(model) != "fp32":
        raise GraphError(f"the model's weights are already {model_weights(model)}")
    return [(p.key, p.value) for p in model.metadata_props]


def _record_precision(
    result: onnx.ModelProto,
    metadata: list[tuple[str, str]],
    weights: Weights,
    scheme: str | None,
) -> onnx.ModelProto:
    """``result`` with the source's ``metadata``, the precision it was stored in and how
    (``scheme``, :data:`SCHEMES`)."""
    metadata = [
        (k, stored_info_json(v, weights) if k == DECODER_METADATA_KEY else v)
        for k, v in metadata
        if k not in (WEIGHTS_METADATA_KEY, SCHEME_METADATA_KEY)
    ]
    del result.metadata_props[:]
    schemes = [(SCHEME_METADATA_KEY, scheme)] if scheme is not None else []
    for key, value in [*metadata, (WEIGHTS_METADATA_KEY, weights), *schemes]:
        entry = result.metadata_props.add()
        entry.key, entry.value = key, value
    return result


def stored_info_json(info_json: str, weights: Weights) -> str:
    """The ``decoder.json`` document ``info_json`` of a decoder whose weights are now stored in
    ``weights``: the precision recorded."""
    info = DecoderInfo.from_json(info_json.encode()).model_copy(update={"weights": weights})
    return info.to_json()


def model_scheme(model_file: Path) -> str | None:
    """The storage scheme recorded in the decoder ``model_file``'s metadata (None: none is)."""
    model = onnx.load(str(model_file), load_external_data=False)
    return next((p.value for p in model.metadata_props if p.key == SCHEME_METADATA_KEY), None)


def current_export(export_dir: Path, weights: Weights) -> bool:
    """Whether ``export_dir`` holds a whole decoder export in ``weights`` stored the current way
    (an int8 or int4 export recorded under an older :data:`SCHEMES` entry, or under none, is
    out of date: a cache should export it again)."""
    if not ((export_dir / DECODER_FILE).is_file() and (export_dir / MODEL_FILE).is_file()):
        return False
    scheme = SCHEMES.get(parse_weights(weights))
    return scheme is None or model_scheme(export_dir / MODEL_FILE) == scheme


def report(source: onnx.ModelProto, converted: onnx.ModelProto) -> Report:
    """Sizes and quantized operators of ``converted`` next to ``source``."""
    ops = Counter(n.op_type for n in converted.graph.node if n.op_type in QUANTIZED_OPS)
    return Report(
        weights=model_weights(converted),
        source_bytes=initializer_bytes(source),
        weight_bytes=initializer_bytes(converted),
        operators=dict(sorted(ops.items())),
    )


def quantize_decoder(
    src_dir: Path,
    dst_dir: Path,
    weights: Weights,
    *,
    steps: Steps | None = None,
) -> Report:
    """Write the decoder export in ``src_dir`` to ``dst_dir`` with its weights in ``weights``.

    Every file but the model is copied (``decoder.json``, tokenizer files); the model is
    loaded with its external data, converted by :func:`quantize_model` and saved (weights to
    ``model.onnx.data`` when over 2 GB). ``dst_dir`` must differ from ``src_dir``.
    """
    steps = steps or Steps()
    done, converted = converted_decoder(src_dir, dst_dir, weights, steps=steps)
    with steps.step(f"writing {dst_dir / MODEL_FILE}"):
        save_model(converted, dst_dir / MODEL_FILE)
    if (dst_dir / DECODER_FILE).is_file():
        with steps.step("checking that a token decodes alike alone and in a verify pass"):
            probe_rows(dst_dir)
    return done


def converted_decoder(
    src_dir: Path,
    dst_dir: Path,
    weights: Weights,
    *,
    steps: Steps,
    layout: Int4Layout = SERVED_INT4,
) -> tuple[Report, onnx.ModelProto]:
    """What :func:`quantize_decoder` writes, but the model: the files beside it are copied to
    ``dst_dir`` (``decoder.json`` with the precision recorded), and the model converted to
    ``weights`` (int4 stored in ``layout``) is returned with its report, for the caller to
    finish and save."""
    weights = parse_weights(weights)
    src_model = src_dir / MODEL_FILE
    if not src_model.is_file():
        raise GraphError(f"{src_dir}: no {MODEL_FILE} (not a decoder export)")
    if dst_dir.resolve() == src_dir.resolve():
        raise GraphError("the quantized decoder must go to another directory than its source")
    dst_dir.mkdir(parents=True, exist_ok=True)
    for item in src_dir.iterdir():
        if item.is_file() and not item.name.startswith((MODEL_FILE, ".")):
            shutil.copy2(item, dst_dir / item.name)
    info_file = dst_dir / DECODER_FILE
    if info_file.is_file():
        info_file.write_text(stored_info_json(info_file.read_text(), weights) + "\n")
    if weights == "int8":
        with steps.step(f"storing the weights of {src_model} in int8"):
            source, converted = _int8_from_file(src_model)
    else:
        with steps.step(f"loading {src_model}"):
            model = onnx.load(str(src_model), load_external_data=True)
        source = _shapes_only(model)
        with steps.step(f"storing the weights in {weights}"):
            converted = quantize_model(model, weights, layout)
    return report(source, converted), converted


def _shapes_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model holding only ``model``'s initializer declarations (no data): enough for sizes."""
    light = onnx.ModelProto()
    for tensor in model.graph.initializer:
        declared = light.graph.initializer.add()
        declared.name, declared.data_type = tensor.name, tensor.data_type
        declared.dims.extend(tensor.dims)
    return light


def per_pass_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (float32, weights loaded) in int8 as ``quantize_dynamic`` alone stores it:
    activations quantized once per pass, so the rows of a pass are coupled. Not what the export
    writes (:func:`quantize_model` quantizes them per row); ``bench/int8_rows.py`` compares the
    two. ``model`` itself may be modified."""
    metadata = _float_metadata(model)
    with quiet_quantizer():
        result = dynamic_int8(fold_weight_transposes(without_row_padding(model)))
    return _record_precision(result, metadata, "int8", SCHEMES["int8"])


def _int8_from_file(src_model: Path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The float32 decoder ``src_model`` (declarations only, for :func:`report`) and its int8
    conversion, as :func:`quantize_model` makes it.

    ONNX Runtime's quantizer loads the model again (and a shape-inferred copy), so the float32
    weights are dropped before it runs: Qwen 1.5B's 6.6 GB held beside it did not fit in 24 GiB.
    """
    with tempfile.TemporaryDirectory(prefix="fedshard-int8-") as tmp:
        folded, out = Path(tmp) / "source.onnx", Path(tmp) / MODEL_FILE
        source, metadata = _folded_copy(src_model, folded)
        with quiet_quantizer():
            quantize_dynamic_file(folded, out)
        converted = per_row_int8(onnx.load(str(out), load_external_data=True))
    return source, _record_precision(converted, metadata, "int8", SCHEMES["int8"])


def _folded_copy(src_model: Path, out: Path) -> tuple[onnx.ModelProto, list[tuple[str, str]]]:
    """Write ``src_model`` with its weight transposes folded to ``out`` (external data); its
    declarations and metadata. The loaded weights are released on return."""
    model = without_row_padding(onnx.load(str(src_model), load_external_data=True))
    metadata = _float_metadata(model)
    source = _shapes_only(model)
    onnx.save_model(fold_weight_transposes(model), str(out), save_as_external_data=True)
    return source, metadata
