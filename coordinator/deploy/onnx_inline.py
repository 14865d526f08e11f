"""One self-contained ONNX file from a graph whose weights live in an external data file,
written one tensor at a time.

A segment is pushed to its agent as one file. The GGUF builder writes each segment's weights
to a data file beside the graph as it maps them; this module joins the two without loading
the model: protocol buffers concatenate, so the file is the graph's other fields, then each
external initializer as its own ``GraphProto.initializer`` record (its header, then its bytes
as ``raw_data`` read from the data file), with every length computed before a byte is written.
The process holds one tensor's bytes at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import TensorProto

MODEL_GRAPH_TAG = bytes([7 << 3 | 2])
GRAPH_INITIALIZER_TAG = bytes([5 << 3 | 2])
TENSOR_RAW_DATA_TAG = bytes([9 << 3 | 2])


@dataclass(frozen=True)
class _External:
    header: bytes
    """The TensorProto without its data or its external-data reference."""
    location: str
    offset: int
    length: int

    @property
    def record_bytes(self) -> int:
        return len(self.header) + len(TENSOR_RAW_DATA_TAG) + _varint_size(self.length) + self.length


def inline_external_data(src: Path, dst: Path) -> int:
    """Write ``src`` (a graph with external data beside it) as the single file ``dst``; its
    size in bytes."""
    proto = onnx.load(str(src), load_external_data=False)
    graph = proto.graph
    kept: list[TensorProto] = []
    external: list[_External] = []
    for tensor in graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            external.append(_describe(tensor))
        else:
            kept.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph_head = graph.SerializeToString()
    proto.ClearField("graph")
    model_head = proto.SerializeToString()
    graph_len = len(graph_head) + sum(
        len(GRAPH_INITIALIZER_TAG) + _varint_size(e.record_bytes) + e.record_bytes for e in external
    )
    with dst.open("wb") as out:
        out.write(model_head)
        out.write(MODEL_GRAPH_TAG + _varint(graph_len))
        out.write(graph_head)
        for e in external:
            out.write(GRAPH_INITIALIZER_TAG + _varint(e.record_bytes))
            out.write(e.header)
            out.write(TENSOR_RAW_DATA_TAG + _varint(e.length))
            _copy(src.parent / e.location, e.offset, e.length, out)
        return out.tell()


def _describe(tensor: TensorProto) -> _External:
    info = {entry.key: entry.value for entry in tensor.external_data}
    header = TensorProto()
    header.CopyFrom(tensor)
    header.ClearField("external_data")
    header.ClearField("data_location")
    header.ClearField("raw_data")
    return _External(
        header=header.SerializeToString(),
        location=info["location"],
        offset=int(info.get("offset", "0")),
        length=int(info["length"]),
    )


CHUNK = 16 << 20


def _copy(path: Path, offset: int, length: int, out: BinaryIO) -> None:
    with path.open("rb") as data:
        data.seek(offset)
        left = length
        while left > 0:
            chunk = data.read(min(CHUNK, left))
            if not chunk:
                raise OSError(f"{path} ends before byte {offset + length}")
            out.write(chunk)
            left -= len(chunk)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_size(value: int) -> int:
    return len(_varint(value))
