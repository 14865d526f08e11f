"""A lean GGUF reader: metadata and tensor infos parsed in one pass, tensor data memory-mapped.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array: on a file
with a 262k-token vocabulary (Gemma 3) that took 48 s and 780 MB resident before any weight
was read. Here arrays are skipped (only their length is kept, as ``{key}.count``) and the
scalar and string values are decoded with :mod:`struct`; tensor data are views into one
read-only ``numpy.memmap``, shaped as ``GGUFReader`` shapes them (quantized types: uint8
``[..., rows, row bytes]``; F32/F16 as floats; BF16 as raw uint8 bytes).

Format (ggml ``docs/gguf.md``): magic ``GGUF``, version (2 or 3), tensor count, KV count, the KV
pairs, the tensor infos, padding to ``general.alignment`` (32), the data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from partitioner.errors import GraphError

T = GGMLQuantizationType
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
"""GGUF value type codes to struct formats (8 is a string, 9 an array)."""
STRING, ARRAY = 8, 9
_FLOAT_VIEWS = {T.F32: np.float32, T.F16: np.float16}


class GgufFormatError(GraphError, ValueError):
    """The file is not a GGUF file this reader understands (a ValueError too, as gguf-py's
    reader raises for a bad file)."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's info as stored: ``dims`` innermost first (GGUF's ``ne``)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    """Absolute byte offset of the data in the file."""

    @property
    def n_bytes(self) -> int:
        """Bytes of data."""
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.dims, dtype=np.int64)) * size // block


class _Cursor:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise GgufFormatError("GGUF file ends inside its header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        length = self.take("<Q")
        return str(self.f.read(length), "utf-8", errors="replace")

    def skip_string(self) -> None:
        self.f.seek(self.take("<Q"), 1)

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GgufFormatError(f"unknown GGUF value type {kind}")
        return self.take(fmt)

    def array(self) -> list[Any]:
        kind, count = self.take("<I"), self.take("<Q")
        if kind == STRING:
            return [self.string() for _ in range(count)]
        if kind == ARRAY:
            return [self.array() for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GgufFormatError(f"unknown GGUF array type {kind}")
        size = struct.calcsize(fmt)
        data = self.f.read(size * count)
        return list(np.frombuffer(data, np.dtype(fmt)).tolist())

    def skip_array(self) -> int:
        kind, count = self.take("<I"), self.take("<Q")
        if kind == STRING:
            for _ in range(count):
                self.skip_string()
        elif kind == ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            fmt = _SCALARS.get(kind)
            if fmt is None:
                raise GgufFormatError(f"unknown GGUF array type {kind}")
            self.f.seek(struct.calcsize(fmt) * count, 1)
        return int(count)


class GgufFile:
    """A GGUF file's metadata (scalars and strings; arrays as ``{key}.count``), its tensor
    infos in file order, and its tensors' data as views of one read-only memory map."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            cur = _Cursor(f)
            if f.read(4) != MAGIC:
                raise GgufFormatError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
            version = cur.take("<I")
            if version not in (2, 3):
                raise GgufFormatError(f"GGUF version {version} is not read here (2 or 3)")
            n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
            self.metadata: dict[str, Any] = {}
            self._arrays: dict[str, int] = {}
            for _ in range(n_kv):
                key, kind = cur.string(), cur.take("<I")
                if kind == ARRAY:
                    self._arrays[key] = f.tell()
                    self.metadata[f"{key}.count"] = cur.skip_array()
                else:
                    self.metadata[key] = cur.value(kind)
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = tuple(int(cur.take("<Q")) for _ in range(cur.take("<I")))
                kind, offset = cur.take("<I"), cur.take("<Q")
                infos.append((name, dims, kind, offset))
            align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
            start = f.tell()
            start += -start % align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, kind, offset in infos:
            try:
                ggml_type = T(kind)
            except ValueError:
                raise GgufFormatError(f"tensor {name!r} has unknown type {kind}") from None
            self.tensors[name] = TensorInfo(name, dims, ggml_type, start + offset)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def data(self, name: str) -> np.ndarray:
        """Tensor ``name``'s data, a view into the mapping (shaped as ``GGUFReader`` does)."""
        info = self.tensors[name]
        raw = self._map[info.offset : info.offset + info.n_bytes]
        shape = tuple(reversed(info.dims))
        view = _FLOAT_VIEWS.get(info.ggml_type)
        if view is not None:
            return raw.view(view).reshape(shape)
        return raw.reshape(quant_shape_to_byte_shape(shape, info.ggml_type))

    def array(self, key: str) -> list[Any] | None:
        """Metadata array ``key`` decoded (strings, numbers; nested arrays as lists), or None
        when the file has no such array (the tokenizer's ``tokens``, ``merges``, ...)."""
        start = self._arrays.get(key)
        if start is None:
            return None
        with self.path.open("rb") as f:
            f.seek(start)
            return _Cursor(f).array()

    def release(self) -> None:
        """Drop the mapped pages from this process's resident set (``MADV_DONTNEED``; the
        page cache keeps them), so a builder reading tensor after tensor holds about one."""
        mapping = getattr(self._map, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)
