"""The precisions a decoder's weights can be stored in (light to import: no onnx)."""

from __future__ import annotations

from typing import Literal, get_args

Weights = Literal["fp32", "fp16", "int8", "int4"]
WEIGHTS: tuple[Weights, ...] = get_args(Weights)
"""The precisions ``fedshard export --weights`` offers."""
