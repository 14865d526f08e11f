"""Thin file I/O for ONNX models: load, save (external data past 2 GB), hash.

Everything else in the partitioner works on in-memory ``ModelProto`` objects; this is the only
module that reads or writes model files. Large weights stored as external data are *not* read
at load time: the loaded model keeps references to its data files (relative to the model's
directory), analysis needs only their shapes, and :func:`save_model` streams each segment's
weights straight from the source files. Models of any size therefore load in seconds and never
pass through a single protobuf message.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import onnx
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import TensorProto, external_data_helper

from partitioner.analysis.costs import tensor_proto_bytes
from partitioner.errors import GraphError

PROTOBUF_LIMIT_BYTES = 2**31 - 1
"""A serialised protobuf message cannot exceed 2 GiB."""

EXTERNAL_DATA_MARGIN_BYTES = 64 * 1024 * 1024
"""Headroom for the graph itself: weights beyond ``limit - margin`` go to an external file."""

INLINE_ON_LOAD_BYTES = 1024 * 1024
"""External tensors up to this size are read at load time (shape arithmetic needs values)."""

EXTERNAL_MIN_BYTES = 1024
"""When a segment uses external data, tensors at least this big go to the data file."""

EXTERNAL_DATA_SHA256_KEY = "fedshard.external_data.sha256"
"""Metadata key under which a model saved with external data records that file's SHA-256.

The hash of the ``.onnx`` file then covers the weights too, so a manifest that lists only the
``.onnx`` file still pins every byte a device loads.
"""

_CHUNK = 16 * 1024 * 1024
_ALIGN = 4096


def load_model(path: Path) -> onnx.ModelProto:
    """Load an ONNX model and inline any model-local functions.

    External tensors larger than :data:`INLINE_ON_LOAD_BYTES` stay references to their files
    (resolve them with :func:`save_model`'s ``source_dir``, the model's directory). Raises
    :class:`GraphError` when the file is missing or is not a valid ONNX model.
    """
    if not path.is_file():
        raise GraphError(f"{path}: no such model file")
    try:
        model = onnx.load(str(path), load_external_data=False)
        base = str(path.parent)
        for tensor in _attribute_tensors(model.graph):
            if external_data_helper.uses_external_data(tensor):
                external_data_helper.load_external_data_for_tensor(tensor, base)
        for tensor in model.graph.initializer:
            if (
                external_data_helper.uses_external_data(tensor)
                and tensor_proto_bytes(tensor) <= INLINE_ON_LOAD_BYTES
            ):
                external_data_helper.load_external_data_for_tensor(tensor, base)
    except (OSError, ValueError, DecodeError, onnx.checker.ValidationError) as exc:
        raise GraphError(f"{path}: cannot load ONNX model: {exc}") from exc
    if not model.graph.node:
        raise GraphError(f"{path}: the graph has no nodes (is this an ONNX model?)")
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    return model


def _attribute_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _attribute_tensors(attr.g)
            for sub in attr.graphs:
                yield from _attribute_tensors(sub)


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Total bytes of the model's weights, from their declared shapes and element types."""
    return sum(tensor_proto_bytes(t) for t in model.graph.initializer)


def save_model(
    model: onnx.ModelProto,
    path: Path,
    *,
    source_dir: Path | None = None,
    external_threshold_bytes: int | None = None,
) -> list[Path]:
    """Write ``model`` to ``path``; weights go to ``<path>.data`` when the model is too big.

    Tensors that still reference external data are read from ``source_dir`` (the directory of
    the model they came from). ``external_threshold_bytes`` (default: just under the 2 GiB
    protobuf limit) is the weight size above which external data is used; the data file's
    SHA-256 is then recorded in the model's metadata under :data:`EXTERNAL_DATA_SHA256_KEY`.
    ``model`` is modified (its tensors end up pointing at the new files). Returns every file
    written, the ``.onnx`` file first.
    """
    limit = (
        PROTOBUF_LIMIT_BYTES - EXTERNAL_DATA_MARGIN_BYTES
        if external_threshold_bytes is None
        else external_threshold_bytes
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    data_path = path.with_name(path.name + ".data")
    if data_path.exists():
        data_path.unlink()
    tensors = list(model.graph.initializer)
    if initializer_bytes(model) <= limit:
        for tensor in tensors:
            if external_data_helper.uses_external_data(tensor):
                tensor.raw_data = _read_all(tensor, source_dir)
                _clear_external(tensor)
        _save(model, path)
        return [path]
    with data_path.open("wb") as fh:
        out = _HashingWriter(fh)
        for tensor in tensors:
            movable = tensor.data_type != TensorProto.STRING
            if movable and tensor_proto_bytes(tensor) >= EXTERNAL_MIN_BYTES:
                _move_to(tensor, out, data_path.name, source_dir)
    entry = model.metadata_props.add()
    entry.key, entry.value = EXTERNAL_DATA_SHA256_KEY, out.digest.hexdigest()
    _save(model, path)
    return [path, data_path]


def _save(model: onnx.ModelProto, path: Path) -> None:
    try:
        onnx.save_model(model, str(path))
    except ValueError as exc:
        raise GraphError(f"{path}: cannot save model: {exc}") from exc


def _clear_external(tensor: TensorProto) -> None:
    tensor.data_location = TensorProto.DEFAULT
    del tensor.external_data[:]


class _HashingWriter:
    """Writes to a binary file while hashing everything written."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.fh.write(data)
        self.digest.update(data)

    def tell(self) -> int:
        return self.fh.tell()


_DATA_FIELDS = (
    "raw_data",
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def _move_to(tensor: TensorProto, out: _HashingWriter, location: str, source: Path | None) -> None:
    """Append a tensor's bytes to ``out`` (aligned) and point the tensor at them."""
    out.write(b"\0" * (-out.tell() % _ALIGN))
    offset = out.tell()
    if external_data_helper.uses_external_data(tensor):
        for chunk in _external_chunks(tensor, source):
            out.write(chunk)
    else:
        out.write(tensor.raw_data if tensor.HasField("raw_data") else _as_raw(tensor))
        for field in _DATA_FIELDS:
            tensor.ClearField(field)
    length = out.tell() - offset
    _clear_external(tensor)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _as_raw(tensor: TensorProto) -> bytes:
    from onnx import numpy_helper

    return bytes(numpy_helper.to_array(tensor).tobytes())


def _external_file(tensor: TensorProto, source: Path | None) -> tuple[Path, int, int]:
    """The source file, offset and length of an external tensor (inside ``source`` only)."""
    if source is None:
        raise GraphError(f"tensor {tensor.name!r} has external data but no source directory")
    info = external_data_helper.ExternalDataInfo(tensor)
    base = source.resolve()
    file = (base / info.location).resolve()
    if base != file and base not in file.parents:
        raise GraphError(f"tensor {tensor.name!r}: external data {info.location!r} escapes {base}")
    offset = int(info.offset or 0)
    length = int(info.length) if info.length is not None else tensor_proto_bytes(tensor)
    if not file.is_file() or os.path.getsize(file) < offset + length:
        raise GraphError(f"tensor {tensor.name!r}: {file} is missing or too short")
    return file, offset, length


def _external_chunks(tensor: TensorProto, source: Path | None) -> Iterator[bytes]:
    file, offset, length = _external_file(tensor, source)
    with file.open("rb") as fh:
        fh.seek(offset)
        left = length
        while left:
            chunk = fh.read(min(_CHUNK, left))
            if not chunk:
                raise GraphError(f"tensor {tensor.name!r}: {file} ended early")
            left -= len(chunk)
            yield chunk


def _read_all(tensor: TensorProto, source: Path | None) -> bytes:
    return b"".join(_external_chunks(tensor, source))
