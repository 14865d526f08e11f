"""What the coordinator's ServerApp and the agents' ClientApp agree on for federated fine-tuning.

The ServerApp sends, with every fit instruction, a :class:`TrainPlan` as a JSON string under the
config key :data:`TRAIN_PLAN_KEY`. The parameter arrays travel in the plan's order: every
trainable shard in segment order, and within a shard its parameters in :attr:`ShardSpec.params`
order. A client that trains only some shards returns the others unchanged, so every reply has the
same layout (which SecAgg+ needs); the server reads which shards a client trained from the
:data:`METRIC_TRAINED_SHARDS` metric and averages each shard over those clients only.

A device's training data is a directory holding :data:`TRAIN_DATA_FILE`, a NumPy ``.npz`` archive
(no pickled objects) with ``x`` (model input, float32) and ``y`` (class index, int64).
"""

from __future__ import annotations

from typing import Final, Literal, Self

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from protocols.base import FrozenModel

TRAIN_PLAN_FORMAT: Final = "fedshard.trainplan/1"
TRAIN_PLAN_KEY: Final = "fedshard-train-plan"
"""Fit-config key holding the :class:`TrainPlan` JSON."""
METRIC_TRAINED_SHARDS: Final = "trained-shards"
"""Fit metric: comma-separated segment indices the client trained ("" for none)."""
METRIC_EXAMPLES: Final = "examples"
METRIC_LOSS: Final = "train-loss"
METRIC_ACCURACY: Final = "train-accuracy"
METRIC_UPLOAD_BYTES: Final = "upload-bytes"
TRAIN_DATA_FILE: Final = "data.npz"


class ParamSpec(FrozenModel):
    """One trainable initializer of a segment."""

    name: str
    shape: list[NonNegativeInt]


class ShardSpec(FrozenModel):
    """A trainable segment: its index, file, hash and parameters in wire order."""

    index: NonNegativeInt
    file: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    params: list[ParamSpec] = Field(min_length=1)


class TrainPlan(FrozenModel):
    """The shards a round may train and how to train them."""

    format: Literal["fedshard.trainplan/1"] = TRAIN_PLAN_FORMAT
    shards: list[ShardSpec] = Field(min_length=1)
    local_epochs: PositiveInt = 1
    batch_size: PositiveInt = 32
    learning_rate: PositiveFloat = 0.05
    uniform_weights: bool = False
    """Report one example per client (DP needs every client to weigh the same)."""

    @model_validator(mode="after")
    def _check_order(self) -> Self:
        indices = [s.index for s in self.shards]
        if indices != sorted(set(indices)):
            raise ValueError("shards must be listed once each, in segment order")
        return self

    @property
    def num_arrays(self) -> int:
        """How many parameter arrays travel with each message."""
        return sum(len(s.params) for s in self.shards)
