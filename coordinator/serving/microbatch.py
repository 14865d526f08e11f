"""Micro-batches: a large embeddings request runs as several runs of bounded size.

Each stage's activation workspace grows with batch x padded sequence length, and ONNX Runtime's
arena keeps its peak; one request of 64 inputs of 256 tokens took every stage of a MiniLM
deployment planned at 22-60 MB to over a gigabyte. So the texts of one request are cut, in
order, into micro-batches whose padded size (inputs x longest input, in tokens) stays within
:data:`MICRO_BATCH_TOKENS`, and run one after the other; every micro-batch must come back from
the same plan version, so the caller's answer is still computed whole by one version.
"""

from __future__ import annotations

from collections.abc import Sequence

MICRO_BATCH_TOKENS = 512
"""Most padded tokens (inputs x longest) one run through the stages may carry. Three MiniLM
agents after 64 inputs of 256 tokens: +2 to +29 MB resident at 512, 305-345 MB at 2,048, and
1.4-1.5 GB as one batch."""


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
