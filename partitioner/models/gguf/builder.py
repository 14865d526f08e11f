"""Decoder segments straight from a GGUF file: one layer range at a time, streaming.

The segment contract (what a stage built here takes and gives; :mod:`protocols.decoder` names)
-------------------------------------------------------------------------------------------
A segment covers the blocks ``[start, end)`` of the file, plus the embedding when ``first``
and the final norm and output head when ``last``. Batch ``batch``, ``q`` new tokens this step,
``total = past + q``:

Inputs
    ``input_ids`` int64 ``[batch, sequence]`` (``first`` only), or ``hidden.{start}`` float32
    ``[batch, sequence, hidden]`` (every other segment): the hidden state entering block
    ``start``. ``attention_mask`` int64 ``[batch, total_sequence]`` and ``position_ids`` int64
    ``[batch, sequence]`` (segments with at least one block: masks and RoPE are rebuilt from
    these two in every segment). ``past.{i}.key`` / ``past.{i}.value`` float32 ``[batch,
    kv_heads, past_sequence, head_dim]`` for every block ``i`` in the range.
Outputs
    ``hidden.{end}`` float32 ``[batch, sequence, hidden]`` (every segment but the last), or
    ``top_logits`` float32 / ``top_ids`` int64 ``[batch, top_k]`` and ``trailing_top_logits`` /
    ``trailing_top_ids`` ``[batch, trailing, top_k]`` (``last``: the step's last
    ``min(q, TRAILING_POSITIONS)`` positions, oldest first; ``top_*`` is the last of them).
    ``present.{i}.key`` / ``present.{i}.value`` float32 ``[batch, kv_heads, total_sequence,
    head_dim]``: the past grown by ``q`` on axis 2, for every block in the range (sliding
    layers mask instead of truncating).

So segments chain by name exactly as a split decoder's do (the outer names are the whole
model's; ``hidden.{k}`` is the one tensor between stages), and the KV cache pairs are
:func:`protocols.decoder.past_name` / ``present_name`` of the file's block index. The graph
carries no weights of blocks outside its range: :func:`write_segment` reads each tensor of the
range from the memory-mapped file, maps it (:mod:`.kernels`), appends it to the segment's
external data file and drops it, so the process holds about one tensor at a time.

Rows: no float product of a segment runs on one row (the attention's, float weights', min
terms'; :func:`.kernels_codes.at_least_two_rows`), and the attention scores are computed so the
context length never picks the kernel's blocking (:func:`.archs._attend`): a one-token step adds
as a pass of several tokens does; ``MatMulNBits`` computes each row alike on the CPUs where it
does. Whether a pass of ``k`` tokens then decodes as ``k`` one-token steps, bit for bit, is
probed on the built segments (:mod:`.rows`), and speculative decoding runs only where it does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

from partitioner.errors import GraphError
from partitioner.models.gguf import archs, ends
from partitioner.models.gguf.header import GgufModel, header_of
from partitioner.models.gguf.heap import release_freed_heap
from partitioner.models.gguf.kernels import ACCURACY_LEVEL, WeightsMode
from partitioner.models.gguf.reader import GgufFile
from protocols.decoder import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_POSITIONS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    past_name,
    present_name,
)

OPSET = 17
MS_OPSET = 1
DEFAULT_TOP_K = 64
EXTERNAL_THRESHOLD = 1024
"""Initializers of at least this many bytes go to the external data file."""
ALIGN = 4096
"""External data offsets are page-aligned, so ONNX Runtime may map them."""
TRIM_THRESHOLD = 8 << 20
"""After writing a tensor of at least this many bytes the C heap's freed memory is given back
(its codes, bytes and protobuf copies, freed below glibc's mmap threshold, would stay)."""


def hidden_name(block: int) -> str:
    """The hidden state entering block ``block`` (the tensor between stages)."""
    return f"hidden.{block}"


@dataclass(frozen=True)
class SegmentRange:
    """Blocks ``[start, end)``, with the embedding (``first``) and the head (``last``)."""

    start: int
    end: int
    first: bool
    last: bool

    def check(self, model: GgufModel) -> None:
        """:class:`GraphError` unless the range is inside the model and holds something."""
        ok = 0 <= self.start <= self.end <= model.layers
        ok = (
            ok
            and (self.start == 0 or not self.first)
            and (self.end == model.layers or not self.last)
        )
        if not ok or (self.start == self.end and not (self.first or self.last)):
            raise GraphError(f"bad segment range {self} for a model of {model.layers} blocks")


class GgufSource:
    """An open GGUF file: its header and raw tensors, memory-mapped."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.file = GgufFile(path)
        self.model = header_of(self.file)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s data as ``GGUFReader`` gives it (a view into the mapping)."""
        self.model.tensor(name)
        return self.file.data(name)


def _value(name: str, elem: int, dims: list[str | int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _kv(name: str, model: GgufModel, axis2: str) -> onnx.ValueInfoProto:
    return _value(name, TensorProto.FLOAT, ["batch", model.kv_heads, axis2, model.head_dim])


def build_segment(
    source: GgufSource,
    span: SegmentRange,
    sink: archs.Sink,
    *,
    weights: WeightsMode = "keep",
    top_k: int = DEFAULT_TOP_K,
    trailing: int = TRAILING_POSITIONS,
    accuracy_level: int = ACCURACY_LEVEL,
    chunk_values: int = archs.CHUNK_VALUES,
) -> onnx.ModelProto:
    """The segment of ``span`` (module docstring); each initializer passes ``sink`` as made.

    ``accuracy_level``: ``MatMulNBits``' (4: int8 activations, ONNX Runtime's fast path and
    llama.cpp's practice; 0: float activations, exact to float rounding, slow).
    ``chunk_values``: the embedding and output head are mapped in row pieces of about this
    many values (bounds the builder's memory; see :data:`archs.CHUNK_VALUES`).
    """
    model = source.model
    span.check(model)
    if not 1 <= top_k <= model.vocab:
        raise GraphError(f"top_k must be between 1 and the vocabulary size {model.vocab}")
    e = archs.Emitter(
        model, source.raw, sink, weights, accuracy_level, source.file.release, chunk_values
    )
    blocks = range(span.start, span.end)
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    hidden = [
        _value(hidden_name(k), TensorProto.FLOAT, ["batch", "sequence", model.hidden])
        for k in (span.start, span.end)
    ]
    if span.first:
        inputs.append(_value(INPUT_IDS, TensorProto.INT64, ["batch", "sequence"]))
        x = ends.embedding(e)
    else:
        inputs.append(hidden[0])
        x = hidden_name(span.start)
    if blocks:
        inputs.append(_value(ATTENTION_MASK, TensorProto.INT64, ["batch", "total_sequence"]))
        inputs.append(_value(POSITION_IDS, TensorProto.INT64, ["batch", "sequence"]))
    for i in blocks:
        inputs += [_kv(past_name(i, kind), model, "past_sequence") for kind in ("key", "value")]
        x = archs.layer(e, i, x)
    if span.last:
        ends.head(e, x, trailing, top_k)
        outputs += [
            _value(TOP_LOGITS, TensorProto.FLOAT, ["batch", top_k]),
            _value(TOP_IDS, TensorProto.INT64, ["batch", top_k]),
            _value(TRAILING_TOP_LOGITS, TensorProto.FLOAT, ["batch", "trailing", top_k]),
            _value(TRAILING_TOP_IDS, TensorProto.INT64, ["batch", "trailing", top_k]),
        ]
    else:
        e.op("Identity", [x], hidden_name(span.end))
        outputs.append(hidden[1])
    for i in blocks:
        outputs += [
            _kv(present_name(i, kind), model, "total_sequence") for kind in ("key", "value")
        ]
    graph = helper.make_graph(
        e.nodes, f"{model.name} blocks {span.start}-{span.end}", inputs, outputs, e.initializers
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", MS_OPSET)]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name="fedshard.gguf")
    proto.ir_version = 8
    return proto


def in_memory(tensor: TensorProto) -> TensorProto:
    """A sink that keeps every initializer in the graph (small models, tests)."""
    return tensor


class ExternalSink:
    """Appends each initializer's bytes to an open data file and keeps only a reference."""

    def __init__(self, out: BinaryIO, location: str) -> None:
        self._out = out
        self._location = location
        self.offset = 0
        self.bytes_written = 0

    def __call__(self, tensor: TensorProto) -> TensorProto:
        """Write ``tensor``'s bytes out (small ones stay inline); returns the reference.

        The reference is a new message: clearing ``raw_data`` would not free it (the upb
        protobuf keeps a message's bytes in its arena until the message itself is dropped), so
        the graph would hold every weight it was built from until the segment is saved."""
        if not tensor.HasField("raw_data"):
            return tensor
        data = tensor.raw_data
        if len(data) < EXTERNAL_THRESHOLD:
            return tensor
        pad = -self.offset % ALIGN
        self._out.write(b"\0" * pad)
        self.offset += pad
        self._out.write(data)
        length = len(data)
        del data
        reference = TensorProto(name=tensor.name, data_type=tensor.data_type)
        reference.dims.extend(tensor.dims)
        reference.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self._location),
            ("offset", self.offset),
            ("length", length),
        ):
            entry = reference.external_data.add()
            entry.key, entry.value = key, str(value)
        self.offset += length
        self.bytes_written += length
        if length >= TRIM_THRESHOLD:
            release_freed_heap()
        return reference


@contextmanager
def _data_file(path: Path) -> Iterator[BinaryIO]:
    with path.open("wb") as out:
        yield out


def write_segment(
    path: Path,
    source: GgufSource,
    span: SegmentRange,
    *,
    weights: WeightsMode = "keep",
    top_k: int = DEFAULT_TOP_K,
    trailing: int = TRAILING_POSITIONS,
    accuracy_level: int = ACCURACY_LEVEL,
) -> list[Path]:
    """Write the segment of ``span`` to ``path`` with its weights in ``path.data`` beside it,
    one tensor at a time; returns the files written (the graph first)."""
    data = path.with_name(path.name + ".data")
    with _data_file(data) as out:
        sink = ExternalSink(out, data.name)
        proto = build_segment(
            source,
            span,
            sink,
            weights=weights,
            top_k=top_k,
            trailing=trailing,
            accuracy_level=accuracy_level,
        )
    onnx.save_model(proto, str(path))
    return [path, data]
