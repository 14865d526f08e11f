"""Reading an ``.npz`` request body without trusting it: sizes checked before anything inflates.

A zip member declares its uncompressed size, and Python's zipfile never inflates a member past
it (a member that lies fails its CRC). So the declared sizes are summed and refused over
:data:`MAX_INFLATED_BYTES` before any decompression, every member must be a ``.npy`` array whose
header's shape and dtype fit inside its declared size, object arrays are refused, and every
malformation (not a zip, a bad member, a truncated array) becomes a :class:`RequestError`
(a 4xx), never a 500.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from typing import IO, Any

import numpy as np

from coordinator.errors import RequestError

MAX_INFLATED_BYTES = 64 << 20
"""Most bytes all arrays of one request may take once inflated."""
MAX_MEMBERS = 256
_MALFORMED = (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError, NotImplementedError)


def load_npz(data: bytes) -> dict[str, Any]:
    """The arrays of an ``.npz`` body, by name; raises RequestError."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            _check_members(infos)
            arrays = {}
            for info in infos:
                with archive.open(info) as member:
                    arrays[info.filename[: -len(".npy")]] = _read_member(member, info)
            return arrays
    except (
        zipfile.BadZipFile,
        zlib.error,
        OSError,
        ValueError,
        EOFError,
        NotImplementedError,
    ) as exc:
        raise RequestError(f"the body is not a readable .npz file: {exc}") from exc


def _check_members(infos: list[zipfile.ZipInfo]) -> None:
    if len(infos) > MAX_MEMBERS:
        raise RequestError(f"an .npz body holds at most {MAX_MEMBERS} arrays")
    declared = sum(info.file_size for info in infos)
    if declared > MAX_INFLATED_BYTES:
        raise RequestError(
            f"the .npz arrays would take {declared} bytes, over the {MAX_INFLATED_BYTES}-byte limit"
        )
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise RequestError(f"{info.filename!r} in the .npz body is not an .npy array")


def _read_member(member: IO[bytes], info: zipfile.ZipInfo) -> np.ndarray[Any, Any]:
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise RequestError(f"{info.filename!r}: unsupported .npy version {version}")
    if dtype.hasobject:
        raise RequestError(f"{info.filename!r}: object arrays (pickles) are refused")
    size = math.prod(shape) * dtype.itemsize
    if size > info.file_size:
        raise RequestError(f"{info.filename!r}: its header claims {size} bytes, more than it holds")
    raw = member.read(size + 1)
    if len(raw) != size:
        raise RequestError(f"{info.filename!r}: {len(raw)} bytes of data, expected {size}")
    flat = np.frombuffer(raw, dtype=dtype)
    return (flat.reshape(shape, order="F") if fortran else flat.reshape(shape)).copy()
