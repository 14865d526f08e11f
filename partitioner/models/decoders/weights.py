"""The precisions a decoder's weights can be stored in (light to import: no onnx)."""

from __future__ import annotations

from typing import Literal, get_args

Weights = Literal["fp32", "fp16", "int8", "int4"]
WEIGHTS: tuple[Weights, ...] = get_args(Weights)
"""The precisions ``fedshard export --weights`` offers."""
DRAFT_VOCABULARY = 32768
"""Tokens a draft-only export's head scores by default (``fedshard export --draft``; the most
frequent, the special tokens on top: :mod:`partitioner.models.decoders.draft_head`)."""
DRAFT_BLOCK_SIZE = 128
"""int4 weights per scale and zero point in a draft-only export."""
