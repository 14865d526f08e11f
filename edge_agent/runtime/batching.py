"""Running queued requests of a stateless stage together, as one batch.

A stage whose segment keeps no per-session state and whose every frame input and output has the
same free first axis (the batch axis) can run several queued requests in one ONNX Runtime call:
their inputs are concatenated along that axis and the outputs split back. Weights are read once
for the whole batch, which is what a memory-bound stage (a language model's output head, reading
its whole vocabulary matrix per token) needs to keep up with the stages before it.

Only requests with identical shapes apart from the batch axis, on the same loaded segment, are
batched; anything else runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_agent.runtime.checks import Array, InputSpec

MAX_BATCH = 8
"""Most requests run together in one call."""


def batch_axis_symbol(inputs: Sequence[InputSpec], outputs: Sequence[object]) -> str | None:
    """The symbol naming the shared free first axis of every input and output, if there is one.

    ``outputs`` are ONNX Runtime output shapes (lists of ints, strings or None).
    """
    firsts: set[object] = {spec.shape[0] if spec.shape else None for spec in inputs}
    for shape in outputs:
        dims = list(shape) if isinstance(shape, (list, tuple)) else []
        firsts.add(dims[0] if dims else None)
    if len(firsts) != 1:
        return None
    symbol = firsts.pop()
    return symbol if isinstance(symbol, str) and symbol else None


def signature(feeds: Mapping[str, Array]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What must match for two requests to share a batch: names, dtypes, non-batch shapes."""
    return tuple(sorted((n, str(a.dtype), tuple(a.shape[1:])) for n, a in feeds.items()))


def stack(requests: Sequence[Mapping[str, Array]]) -> tuple[dict[str, Array], list[int]]:
    """Concatenate the requests' inputs along axis 0; the batch size each contributed."""
    names = list(requests[0])
    sizes = [int(r[names[0]].shape[0]) for r in requests]
    feeds = {name: np.concatenate([r[name] for r in requests], axis=0) for name in names}
    return feeds, sizes


def split(outputs: Mapping[str, Array], sizes: Sequence[int]) -> list[dict[str, Array]]:
    """Split batched outputs back into one dict per request."""
    bounds = np.cumsum([0, *sizes])
    return [
        {name: value[bounds[k] : bounds[k + 1]] for name, value in outputs.items()}
        for k in range(len(sizes))
    ]
