"""Checks a frame's tensors against a segment's declared inputs before ONNX Runtime sees them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from edge_agent.errors import InputMismatchError, ShapeLimitError
from protocols.deploy import ShapeLimits
from protocols.frames import DTYPES

Array = npt.NDArray[np.generic]

ORT_TYPES: Mapping[str, str] = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}
"""ONNX Runtime type strings of the element types the frame codec carries."""


@dataclass(frozen=True)
class InputSpec:
    """One declared input: wire dtype name, and per dimension a size, a symbol or None."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...]

    @classmethod
    def from_ort(cls, name: str, ort_type: str, shape: Sequence[object]) -> InputSpec:
        """Build from ORT ``NodeArg`` fields; InputMismatchError for types frames lack."""
        dtype = ORT_TYPES.get(ort_type)
        if dtype is None:
            raise InputMismatchError(
                f"input {name!r} has type {ort_type}, which frames cannot carry"
            )
        dims: list[int | str | None] = []
        for dim in shape:
            if (isinstance(dim, int) and dim >= 0) or (isinstance(dim, str) and dim):
                dims.append(dim)
            else:
                dims.append(None)
        return cls(name=name, dtype=dtype, shape=tuple(dims))


def check_tensors(
    specs: Sequence[InputSpec], tensors: Mapping[str, Array], passthrough: Sequence[str]
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Split a frame's tensors into ORT feeds and pass-through tensors, checking both.

    Every declared input must be present with the declared dtype, rank and fixed sizes, and a
    symbolic dimension must have one size across all inputs. Every pass-through name must be
    present. Any other tensor is refused.
    """
    feeds: dict[str, Array] = {}
    symbols: dict[str, tuple[int, str]] = {}
    for spec in specs:
        arr = tensors.get(spec.name)
        if arr is None:
            raise InputMismatchError(f"missing input tensor {spec.name!r}")
        _check_one(spec, arr, symbols)
        feeds[spec.name] = arr
    carried = _carried(feeds, tensors, passthrough)
    unknown = sorted(set(tensors) - set(feeds) - set(carried))
    if unknown:
        raise InputMismatchError(f"unexpected tensor(s) {', '.join(map(repr, unknown[:5]))}")
    return feeds, carried


def _check_one(spec: InputSpec, arr: Array, symbols: dict[str, tuple[int, str]]) -> None:
    """One input's dtype, rank and sizes; records the sizes of its symbolic dimensions."""
    if arr.dtype != DTYPES[spec.dtype]:
        raise InputMismatchError(
            f"tensor {spec.name!r} is {arr.dtype}, the segment expects {spec.dtype}"
        )
    if arr.ndim != len(spec.shape):
        raise InputMismatchError(
            f"tensor {spec.name!r} has rank {arr.ndim}, the segment expects {len(spec.shape)}"
        )
    for axis, (size, want) in enumerate(zip(arr.shape, spec.shape, strict=True)):
        if isinstance(want, int) and size != want:
            raise InputMismatchError(
                f"tensor {spec.name!r} has size {size} on axis {axis}, expected {want}"
            )
        if isinstance(want, str):
            seen = symbols.setdefault(want, (size, spec.name))
            if seen[0] != size:
                raise InputMismatchError(
                    f"dimension {want!r} is {size} in {spec.name!r} but {seen[0]} in {seen[1]!r}"
                )


def _carried(
    feeds: Mapping[str, Array], tensors: Mapping[str, Array], passthrough: Sequence[str]
) -> dict[str, Array]:
    carried: dict[str, Array] = {}
    for name in passthrough:
        arr = feeds.get(name, tensors.get(name))
        if arr is None:
            raise InputMismatchError(f"missing pass-through tensor {name!r}")
        carried[name] = arr
    return carried


def symbol_sizes(specs: Sequence[InputSpec], feeds: Mapping[str, Array]) -> dict[str, int]:
    """The size of every symbolic dimension in checked ``feeds`` (one size per symbol)."""
    sizes: dict[str, int] = {}
    for spec in specs:
        arr = feeds.get(spec.name)
        if arr is None:
            continue
        for size, want in zip(arr.shape, spec.shape, strict=True):
            if isinstance(want, str):
                sizes[want] = int(size)
    return sizes


def check_planned(
    limits: ShapeLimits | None, specs: Sequence[InputSpec], feeds: Mapping[str, Array]
) -> dict[str, int]:
    """Refuse (ShapeLimitError) feeds larger than the planned shapes; their symbol sizes.

    Checked before the frame is queued, so ONNX Runtime never runs, and its arena never grows
    to, a shape the segment's memory was not planned for.
    """
    sizes = symbol_sizes(specs, feeds)
    if limits is not None and (problem := limits.violation(sizes)) is not None:
        raise ShapeLimitError(f"{problem}; send it in smaller runs")
    return sizes
