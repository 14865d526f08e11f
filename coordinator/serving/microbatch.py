"""Micro-batches: a large embeddings request runs as several runs of bounded size.

Each stage's activation workspace grows with batch x padded sequence length, and ONNX Runtime's
arena keeps its peak; one request of 64 inputs of 256 tokens took every stage of a MiniLM
deployment planned at 22-60 MB to over a gigabyte. So the texts of one request are cut, in
order, into micro-batches whose padded size (inputs x longest input, in tokens) stays within
:data:`MICRO_BATCH_TOKENS`, and run one after the other; every micro-batch must come back from
the same plan version, so the caller's answer is still computed whole by one version.

``/v1/infer`` requests are cut the same way along their batch axis by :func:`row_runs`, to the
deployment's planned shapes (:mod:`coordinator.deploy.limits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from coordinator.deploy.limits import MICRO_BATCH_TOKENS
from coordinator.errors import ShapeLimitError
from protocols.deploy import ShapeLimits
from protocols.manifest import TensorInfo

Arrays = dict[str, np.ndarray[Any, Any]]
BATCH = "batch"


def micro_batches(lengths: Sequence[int], budget: int = MICRO_BATCH_TOKENS) -> list[slice]:
    """Consecutive slices of the inputs whose padded size fits ``budget`` (an input longer than
    the budget runs alone)."""
    slices: list[slice] = []
    start, longest = 0, 0
    for i, length in enumerate(lengths):
        widest = max(longest, length)
        if i > start and widest * (i - start + 1) > budget:
            slices.append(slice(start, i))
            start, widest = i, length
        longest = widest
    if lengths:
        slices.append(slice(start, len(lengths)))
    return slices


def row_runs(
    limits: ShapeLimits | None, inputs: Sequence[TensorInfo], feeds: Arrays
) -> list[slice]:
    """Slices of the batch axis (axis 0, named ``batch``) whose runs fit ``limits``.

    One slice when the request fits as it is; ShapeLimitError when it cannot be cut to fit (a
    dimension other than the batch is over its limit, or the inputs have no batch axis).
    """
    rows = next(iter(feeds.values())).shape[0] if feeds else 0
    sizes = _sizes(inputs, feeds)
    if limits is None or limits.violation(sizes) is None:
        return [slice(0, rows)]
    if any(not info.shape or info.shape[0] != BATCH for info in inputs):
        raise ShapeLimitError(f"{limits.violation(sizes)}, and the inputs have no batch axis")
    one = limits.violation({**sizes, BATCH: 1})
    if one is not None:
        raise ShapeLimitError(f"{one}; shorten the input")
    per_run = _rows_per_run(limits, sizes)
    return [slice(start, min(start + per_run, rows)) for start in range(0, rows, per_run)]


def _sizes(inputs: Sequence[TensorInfo], feeds: Arrays) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for info in inputs:
        for want, size in zip(info.shape, feeds[info.name].shape, strict=False):
            if isinstance(want, str):
                sizes[want] = max(sizes.get(want, 0), int(size))
    return sizes


def _rows_per_run(limits: ShapeLimits, sizes: dict[str, int]) -> int:
    """The most batch rows one run may carry (at least 1: one row fits, checked before)."""
    most = limits.dims.get(BATCH, sizes[BATCH])
    if limits.product is not None and BATCH in limits.product_dims:
        others = math.prod(sizes.get(n, 1) for n in limits.product_dims if n != BATCH)
        most = min(most, limits.product // max(others, 1))
    return max(1, most)


def join_runs(outputs: Sequence[Arrays], declared: Sequence[TensorInfo]) -> Arrays:
    """The outputs of consecutive runs joined along the batch axis."""
    if len(outputs) == 1:
        return dict(outputs[0])
    unbatched = [o.name for o in declared if not o.shape or o.shape[0] != BATCH]
    if unbatched:
        raise ShapeLimitError(f"outputs {unbatched} have no batch axis to join runs along")
    return {name: np.concatenate([run[name] for run in outputs]) for name in outputs[0]}
