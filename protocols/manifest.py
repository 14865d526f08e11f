"""``fedshard.manifest/1``: what ``fedshard split`` writes next to the segment files.

Running the segment files in index order, each fed by name from the model inputs and
earlier segments' outputs, yields the model's outputs.
"""

from __future__ import annotations

from typing import Final, Literal, Self

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from protocols.base import FrozenModel
from protocols.constants import MANIFEST_FORMAT
from protocols.decoder import StatePair
from protocols.plan import Objective

MANIFEST_FILE: Final = "manifest.json"
"""The manifest's file name in a segments directory: ``fedshard split``'s output, a deployed or
trained version, a training copy."""

Sha256Hex = str


class TensorInfo(FrozenModel):
    """A graph input or output: name, element type and shape (``None`` or a name for a free dim)."""

    name: str
    dtype: str
    shape: list[int | str | None]


class ModelInfo(FrozenModel):
    """The whole model the segments were cut from."""

    name: str
    sha256: Sha256Hex = Field(pattern=r"^[0-9a-f]{64}$")
    param_bytes: NonNegativeInt
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]


class SegmentEntry(FrozenModel):
    """One segment: which device runs it, its file and the plan's predictions."""

    index: NonNegativeInt
    device: str
    file: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    sha256: Sha256Hex = Field(pattern=r"^[0-9a-f]{64}$")
    inputs: list[str]
    outputs: list[str]
    param_bytes: NonNegativeInt
    predicted_memory_bytes: NonNegativeInt
    predicted_compute_s: NonNegativeFloat
    predicted_prefill_s: NonNegativeFloat | None = None
    """Decoders: the stage's time prefilling a prompt (``predicted_compute_s`` is one decode
    step, what throughput is planned on); None for other models."""
    units: tuple[NonNegativeInt, NonNegativeInt] = (0, 0)
    """Half-open range of planning units this segment holds."""
    state: list[StatePair] = Field(default_factory=list)
    """Per-session state this segment keeps (its layers' KV cache): each ``past`` input is fed
    from the ``present`` output of the session's previous step, on this device; neither ever
    travels in a frame."""
    state_bytes: NonNegativeInt = 0
    """Memory reserved for that state at the plan's sessions and context length (included in
    ``predicted_memory_bytes``)."""


class SessionLimits(FrozenModel):
    """How many sessions of how many tokens each stage keeps state for."""

    max_sessions: PositiveInt
    max_context: PositiveInt
    """Tokens per session (prompt plus generated)."""
    idle_timeout_s: PositiveFloat = 300.0
    """A session with no step for this long is ended and its state freed."""


DEFAULT_SESSIONS = SessionLimits(max_sessions=4, max_context=1024)
"""What a decoder's stages reserve KV memory for unless told otherwise."""


class Manifest(FrozenModel):
    """The ``DIR/manifest.json`` document."""

    format: Literal["fedshard.manifest/1"] = MANIFEST_FORMAT
    model: ModelInfo
    objective: Objective
    bottleneck_s: NonNegativeFloat
    latency_s: NonNegativeFloat
    segments: list[SegmentEntry] = Field(min_length=1)
    sessions: SessionLimits | None = None
    """For a model with per-session state (a decoder): what its memory was planned for."""

    @model_validator(mode="after")
    def _check_indices(self) -> Self:
        if [s.index for s in self.segments] != list(range(len(self.segments))):
            raise ValueError("segments must be listed in index order 0..n-1")
        return self
