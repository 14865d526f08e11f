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


# --------------------------------------------------------------------- training-run API (HTTP)

RunState = Literal["starting", "running", "finished", "failed"]
MAX_API_ROUNDS: Final = 1000


class TrainingRunRequest(FrozenModel):
    """``POST /v1/training/runs``: start a federated fine-tuning run.

    ``rollout_every`` (optional): also roll a new version out after every that many rounds,
    not only at the end of the run.
    """

    rounds: PositiveInt = Field(le=MAX_API_ROUNDS)
    secure_aggregation: bool = True
    dp: bool = True
    rollout_every: PositiveInt | None = None


class TrainingRunCreated(FrozenModel):
    """The answer to ``POST /v1/training/runs``."""

    run_id: str


class RunRound(FrozenModel):
    """One finished round of a run, as the API and console show it."""

    round: PositiveInt
    loss: float
    """Held-out cross-entropy of the global model after the round."""
    accuracy: float
    """Held-out accuracy of the global model after the round."""
    epsilon: float | None
    """Cumulative epsilon after the round (``None`` without differential privacy)."""
    clients: NonNegativeInt
    bytes_uploaded: NonNegativeInt
    """Model-update bytes all clients of the round sent together."""
    seconds: float = Field(ge=0)


class RunRollout(FrozenModel):
    """A version a run produced (and, where a deployment is served, rolled out live)."""

    round: PositiveInt
    version: str
    """The version directory's name (``v0002``, ...)."""
    model_id: str | None = None
    plan_version: PositiveInt | None = None
    """The served deployment's new plan version (``None`` when nothing is served)."""


class RunStatus(FrozenModel):
    """``GET /v1/training/runs/{run_id}``: a run's state and the rounds finished so far."""

    run_id: str
    status: RunState
    error: str | None = None
    """Why the run failed, in plain words (``None`` unless ``status`` is ``failed``)."""
    rounds: list[RunRound] = Field(default_factory=list)
    baseline_accuracy: float | None = None
    """Held-out accuracy before the first round (once known)."""
    rollouts: list[RunRollout] = Field(default_factory=list)


class RunList(FrozenModel):
    """``GET /v1/training/runs``: every run this coordinator started, oldest first."""

    runs: list[RunStatus]


TRAINING_TARGET_FORMAT: Final = "fedshard.training-target/1"


class TrainingTargetSpec(FrozenModel):
    """``fedshard coordinator --training-target FILE``: what the coordinator's runs fine-tune.

    Relative paths are relative to the file's directory. When a deployment serves ``model_id``,
    a run trains its active version's segments and rolls new versions out to it; otherwise it
    trains ``version_dir`` and only writes new version directories.
    """

    format: Literal["fedshard.training-target/1"] = TRAINING_TARGET_FORMAT
    model_id: str = Field(min_length=1, max_length=128)
    version_dir: str = Field(min_length=1)
    """The version to start from (``manifest.json`` plus segment files)."""
    test_file: str = Field(min_length=1)
    """Held-out ``.npz`` (x, y) that stays on the coordinator."""
    client_data: list[str] = Field(default_factory=list)
    """Data directories of local SuperNodes, one each (empty: the agents bring their own)."""
    budgets: list[PositiveInt] = Field(default_factory=list)
    """Training-memory budget of each local SuperNode, in bytes."""

    @model_validator(mode="after")
    def _one_budget_per_client(self) -> Self:
        if len(self.budgets) != len(self.client_data):
            raise ValueError("budgets and client_data must have the same length")
        return self
