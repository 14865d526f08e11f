"""What kind of model file a deploy was given: an ONNX model or a GGUF file, else refused.

A GGUF file starts with the magic ``GGUF``. An ONNX file is a protocol-buffers ``ModelProto``
with no magic; it is recognised by walking its top-level fields (tag, wire type, length) to
the end of the file without reading any payload: every field must be one ``ModelProto``
declares, with its wire type, and the last must end exactly at the end of the file. A text
file, an archive or a truncated download fails that walk within a few bytes, and the deploy
is refused with :class:`~coordinator.errors.ModelFormatError` (HTTP 400 naming the formats
taken) instead of the parser's "Error parsing message" deep inside the cut.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import BinaryIO, Final

from coordinator.errors import ModelFormatError

GGUF_MAGIC: Final = b"GGUF"
ACCEPTED: Final = "an ONNX model (.onnx) or a GGUF file (.gguf)"
"""The formats ``fedshard deploy`` takes, as error messages name them."""

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
MODEL_PROTO_FIELDS: Final = {
    1: VARINT,  # ir_version
    2: LENGTH,  # producer_name
    3: LENGTH,  # producer_version
    4: LENGTH,  # domain
    5: VARINT,  # model_version
    6: LENGTH,  # doc_string
    7: LENGTH,  # graph
    8: LENGTH,  # opset_import
    14: LENGTH,  # metadata_props
    20: LENGTH,  # training_info
    25: LENGTH,  # functions
    26: LENGTH,  # configuration
}
"""``onnx.ModelProto``'s fields (onnx.proto3) and their wire types."""
MAX_FIELDS: Final = 1 << 16


class ModelFormat(enum.Enum):
    """The model file formats a deploy takes."""

    ONNX = "onnx"
    GGUF = "gguf"


def model_format(path: Path) -> ModelFormat:
    """The format of the model file at ``path``; :class:`ModelFormatError` for anything else
    (including a file that cannot be read)."""
    try:
        with path.open("rb") as stream:
            head = stream.read(len(GGUF_MAGIC))
            if head == GGUF_MAGIC:
                return ModelFormat.GGUF
            stream.seek(0)
            size = path.stat().st_size
            if size > 0 and _walks_as_model_proto(stream, size):
                return ModelFormat.ONNX
    except OSError as exc:
        raise ModelFormatError(f"cannot read the model file {path}: {exc}") from exc
    raise ModelFormatError(f"{path.name} is not a model fedshard can read: it takes {ACCEPTED}")


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a readable file that starts with the GGUF magic."""
    try:
        with path.open("rb") as stream:
            return stream.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def _walks_as_model_proto(stream: BinaryIO, size: int) -> bool:
    """Whether the top-level fields of ``stream`` (``size`` bytes) are ``ModelProto``'s and end
    exactly at the end."""
    position = 0
    for _ in range(MAX_FIELDS):
        if position == size:
            return True
        tag = _varint(stream)
        if tag is None:
            return False
        field, wire = tag >> 3, tag & 7
        if MODEL_PROTO_FIELDS.get(field) != wire:
            return False
        if wire == VARINT:
            if _varint(stream) is None:
                return False
        else:
            length = _varint(stream)
            if length is None or stream.tell() + length > size:
                return False
            stream.seek(length, 1)
        position = stream.tell()
    return False


def _varint(stream: BinaryIO) -> int | None:
    """A protocol-buffers varint at the stream's position (None: truncated or over 10 bytes)."""
    value = 0
    for shift in range(0, 70, 7):
        byte = stream.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
    return None
