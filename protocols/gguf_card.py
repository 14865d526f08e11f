"""``fedshard.gguf-card/1``: what a deployed GGUF file is, as ``GET /v1/models`` and the
console show it, and what building its segments cost the coordinator."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from protocols.base import FrozenModel

WeightsMode = Literal["keep", "int4", "int8"]
"""How a GGUF's weights are stored in its segments: the file's own types, or re-quantized."""


class GgufBuild(FrozenModel):
    """The coordinator's cost of building and checking one version's segments from the file."""

    peak_rss_bytes: NonNegativeInt
    """Peak resident memory of the coordinator process while it built and checked them."""
    largest_segment_bytes: NonNegativeInt
    """The largest segment's files (graph plus external data) on disk."""
    segment_bytes: NonNegativeInt
    """All segments' files on disk together."""
    seconds: float = Field(ge=0)
    """Wall time of planning, building and the local check."""
    deploy_peak_rss_bytes: NonNegativeInt | None = None
    """Peak resident memory of the coordinator from the build's start until the version was
    switched to: building, pushing the segments and the health check (None: not measured)."""


class GgufCard(FrozenModel):
    """A deployed GGUF model: the file's own name, architecture, size and quantization mix."""

    format: Literal["fedshard.gguf-card/1"] = "fedshard.gguf-card/1"
    file: str = Field(min_length=1, max_length=4096)
    """The file's name (no directory)."""
    file_bytes: NonNegativeInt
    name: str | None = Field(default=None, max_length=512)
    """``general.name`` from the file's metadata, when it has one."""
    architecture: str = Field(min_length=1, max_length=128)
    """``general.architecture``: ``llama``, ``qwen2``, ``qwen3``, ``gemma3``, ``phi3``."""
    parameters: NonNegativeInt
    """Elements of every tensor in the file."""
    layers: PositiveInt
    quantization: dict[str, NonNegativeInt] = Field(default_factory=dict, max_length=64)
    """Tensor type name (``Q4_K``, ``Q6_K``, ``F32``...) to the parameters stored in it."""
    weights: WeightsMode = "keep"
    """How the segments store the weights (``keep``: in the file's own types)."""
    build: GgufBuild | None = None
