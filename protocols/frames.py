"""Activation frames: the data-plane wire format.

A frame is::

    prefix   16 bytes   b"FSF1" | header length (u32 LE) | payload length (u64 LE)
    header   JSON       FrameHeader: ids, segment index, plan version, tensor names/dtypes/shapes
    payload  raw bytes  each tensor's little-endian bytes, in header order, each padded to 64 bytes

Decoding checks every size against the header and a maximum frame size before it looks at
the payload, accepts only whitelisted dtypes, and returns numpy arrays that are read-only
views into the received buffer (no copy). Nothing here ever unpickles.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Self

import numpy as np
import numpy.typing as npt
import pydantic
from pydantic import Field, NonNegativeInt, model_validator

from protocols.base import FrozenModel
from protocols.constants import DEFAULT_MAX_FRAME_BYTES
from protocols.errors import (
    FrameTooLargeError,
    MalformedFrameError,
    TensorSpecError,
    TruncatedFrameError,
    WireErrorCode,
)

MAGIC: Final = b"FSF1"
PREFIX = struct.Struct("<4sIQ")
PREFIX_BYTES: Final = PREFIX.size
ALIGNMENT: Final = 64
MAX_HEADER_BYTES: Final = 1 << 20
MAX_RANK: Final = 8
MAX_TENSORS: Final = 1024
MAX_NAME_LENGTH: Final = 512

DTYPES: Final[Mapping[str, np.dtype[np.generic]]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "float64": np.dtype("<f8"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
"""The only element types a frame may carry, by wire name."""

_WIRE_NAME = {dtype: name for name, dtype in DTYPES.items()}
_MAX_ARRAY_BYTES: Final = 2**63 - 1
"""numpy refuses a shape whose non-zero dimensions multiply past this, even with a zero dim."""


class TensorSpec(FrozenModel):
    """Name, element type and shape of one tensor in a frame."""

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)
    dtype: str
    shape: list[NonNegativeInt] = Field(max_length=MAX_RANK)


class FrameKind(StrEnum):
    """What a frame is for."""

    DATA = "data"
    """A request, a step, a requester's claim on an answer, or an answer."""
    ERROR = "error"
    """A failure report: ``error_code`` and ``error`` are set, no tensors travel."""
    RELEASE = "release"
    """A requester gives back its claim on an answer it got elsewhere (from the first stage)."""


class FrameHeader(FrozenModel):
    """Everything about a frame except the tensor bytes."""

    request_id: str = Field(min_length=1, max_length=128)
    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    """Set on every step of a generation session; stages with per-session state key it by the
    requester's name and this id."""
    session_position: NonNegativeInt | None = None
    """Tokens the session holds before this step; a stage refuses a step that does not match
    its own count (a replayed or reordered frame)."""
    session_end: bool = False
    """Ends the session: every stage frees its state, then the last answers with no tensors."""
    session_rewind: bool = False
    """Before this step, every stage cuts the session back to ``session_position`` tokens
    (dropping drafted tokens a speculative step rejected); a stage that never held that many
    refuses the step."""
    segment_index: NonNegativeInt = 0
    plan_version: NonNegativeInt = 0
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=MAX_TENSORS)
    kind: FrameKind = FrameKind.DATA
    error_code: WireErrorCode | None = None
    """Why the request failed: set exactly on ``kind="error"`` frames."""
    error: str | None = Field(default=None, max_length=4096)
    """The failure's message, for people: only on ``kind="error"`` frames."""

    @model_validator(mode="after")
    def _error_fields_match_kind(self) -> Self:
        if (self.kind is FrameKind.ERROR) != (self.error_code is not None):
            raise ValueError("error_code is set exactly on error frames")
        if self.kind is not FrameKind.ERROR and self.error is not None:
            raise ValueError("only error frames carry an error message")
        if self.kind is not FrameKind.DATA and self.tensors:
            raise ValueError(f"{self.kind} frames carry no tensors")
        return self

    @property
    def failed(self) -> bool:
        """Whether this frame reports a failure."""
        return self.kind is FrameKind.ERROR

    def failure(self) -> str:
        """``code: message`` of an error frame, for logs and messages."""
        return f"{self.error_code}: {self.error or ''}"


@dataclass(frozen=True)
class Frame:
    """A decoded frame: its header and its tensors by name (read-only views, in header order)."""

    header: FrameHeader
    tensors: dict[str, npt.NDArray[np.generic]]


def tensor_nbytes(spec: TensorSpec) -> int:
    """Byte count of a tensor described by ``spec``; raises TensorSpecError for a bad dtype."""
    return math.prod(spec.shape) * _dtype_of(spec).itemsize


def encode_frame_parts(
    header: FrameHeader, tensors: Mapping[str, npt.NDArray[np.generic]]
) -> list[bytes | memoryview]:
    """Encode a frame as a list of buffers to send in order (scatter-gather, no tensor copy).

    ``header.tensors`` is ignored and rebuilt from ``tensors``. Arrays that are not
    C-contiguous little-endian are converted first (that is the only copy).
    """
    arrays = [(_checked_name(name), _wire_array(name, value)) for name, value in tensors.items()]
    # The header was validated when it was built and the specs come from arrays just checked,
    # so serialise directly instead of re-validating through the model (a hot path).
    fields = header.model_dump()
    fields["tensors"] = [
        {"name": name, "dtype": _WIRE_NAME[arr.dtype], "shape": list(arr.shape)}
        for name, arr in arrays
    ]
    header_bytes = json.dumps(fields, separators=(",", ":")).encode()
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise FrameTooLargeError(f"frame header is {len(header_bytes)} bytes, over the limit")
    parts: list[bytes | memoryview] = [b"", header_bytes]
    payload_len = 0
    for _, arr in arrays:
        parts.append(arr.reshape(-1).view(np.uint8).data)
        pad = -arr.nbytes % ALIGNMENT
        if pad:
            parts.append(bytes(pad))
        payload_len += arr.nbytes + pad
    parts[0] = PREFIX.pack(MAGIC, len(header_bytes), payload_len)
    return parts


def encode_frame(header: FrameHeader, tensors: Mapping[str, npt.NDArray[np.generic]]) -> bytes:
    """Encode a frame into one ``bytes`` object (one copy of the tensor data)."""
    return b"".join(encode_frame_parts(header, tensors))


def frame_length(prefix: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """Total length of the frame that starts with this 16-byte prefix, checked against the limit.

    Lets a stream reader refuse an oversized frame before reading its body.
    """
    if len(prefix) < PREFIX_BYTES:
        raise TruncatedFrameError(f"frame prefix has {len(prefix)} of {PREFIX_BYTES} bytes")
    magic, header_len, payload_len = PREFIX.unpack_from(prefix)
    return _checked_total(magic, header_len, payload_len, max_frame_bytes)


def _checked_total(magic: bytes, header_len: int, payload_len: int, max_frame_bytes: int) -> int:
    if magic != MAGIC:
        raise MalformedFrameError(f"bad frame magic {magic!r}")
    if header_len > MAX_HEADER_BYTES:
        raise FrameTooLargeError(f"frame header of {header_len} bytes is over the limit")
    total = PREFIX_BYTES + header_len + payload_len
    if total > max_frame_bytes:
        raise FrameTooLargeError(f"frame of {total} bytes is over the limit of {max_frame_bytes}")
    return total


def decode_frame(
    data: bytes | bytearray | memoryview, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> Frame:
    """Decode one complete frame; the returned arrays are read-only views into ``data``."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    view = view.toreadonly()
    if len(view) < PREFIX_BYTES:
        raise TruncatedFrameError(f"frame prefix has {len(view)} of {PREFIX_BYTES} bytes")
    magic, header_len, payload_len = PREFIX.unpack_from(view)
    total = _checked_total(magic, header_len, payload_len, max_frame_bytes)
    if len(view) != total:
        if len(view) < total:
            raise TruncatedFrameError(f"frame has {len(view)} of {total} bytes")
        raise MalformedFrameError(f"{len(view) - total} bytes after the end of the frame")
    payload_start = PREFIX_BYTES + header_len
    header = _parse_header(bytes(view[PREFIX_BYTES:payload_start]))
    return Frame(header=header, tensors=_views(header.tensors, view[payload_start:], payload_len))


def _parse_header(raw: bytes) -> FrameHeader:
    try:
        return FrameHeader.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise MalformedFrameError(f"invalid frame header: {exc.errors()[0]['msg']}") from exc


def _views(
    specs: list[TensorSpec], payload: memoryview, payload_len: int
) -> dict[str, npt.NDArray[np.generic]]:
    """Read-only arrays over ``payload`` (itself read-only, so numpy marks them so)."""
    tensors: dict[str, npt.NDArray[np.generic]] = {}
    offset = 0
    for spec in specs:
        dtype = _dtype_of(spec)
        shape = tuple(spec.shape)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize > _MAX_ARRAY_BYTES:
            raise TensorSpecError(f"tensor {spec.name!r} declares an impossible shape {shape}")
        if offset + nbytes > payload_len:
            raise TensorSpecError(f"tensor {spec.name!r} runs past the end of the payload")
        if spec.name in tensors:
            raise MalformedFrameError(f"frame names tensor {spec.name!r} twice")
        tensors[spec.name] = np.frombuffer(payload, dtype, count, offset).reshape(shape)
        offset += nbytes + (-nbytes % ALIGNMENT)
    if offset != payload_len:
        raise MalformedFrameError(f"payload is {payload_len} bytes but tensors need {offset}")
    return tensors


def _dtype_of(spec: TensorSpec) -> np.dtype[np.generic]:
    try:
        return DTYPES[spec.dtype]
    except KeyError:
        raise TensorSpecError(
            f"tensor {spec.name!r} has unsupported dtype {spec.dtype!r}"
        ) from None


def _checked_name(name: str) -> str:
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise TensorSpecError(f"tensor name {name[:40]!r} must have 1 to {MAX_NAME_LENGTH} chars")
    return name


def _wire_array(name: str, value: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
    arr = np.asarray(value)
    wire = _WIRE_NAME.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
    if wire is None:
        raise TensorSpecError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
    if arr.ndim > MAX_RANK:
        raise TensorSpecError(f"tensor {name!r} has rank {arr.ndim}, over {MAX_RANK}")
    return np.asarray(arr, dtype=DTYPES[wire], order="C")
