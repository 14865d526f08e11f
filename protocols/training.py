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
from protocols.ledger import PrivacyStatus

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


TrainingMethod = Literal["shards", "lora"]
MAX_LORA_RANK: Final = 64
MAX_LORA_LEARNING_RATE: Final = 1.0
MAX_LORA_LOCAL_EPOCHS: Final = 20
MAX_LORA_BATCH_SIZE: Final = 1024


class LoraOptions(FrozenModel):
    """``"lora"`` of a run request: adapter rank and scaling, and which layers train.

    ``first_layer`` (default: the second half of the decoder's layers) is the first decoder
    layer that gets adapters; every layer from it on does, on ``target_modules`` (default:
    the attention and MLP projections). ``learning_rate``, ``local_epochs`` and ``batch_size``
    override the coordinator's local-training defaults for this run.
    """

    rank: PositiveInt = Field(default=8, le=MAX_LORA_RANK)
    alpha: PositiveFloat | None = Field(default=None, le=1024)
    """Default: twice the rank."""
    first_layer: NonNegativeInt | None = None
    target_modules: list[str] | None = Field(default=None, min_length=1, max_length=16)
    learning_rate: PositiveFloat | None = Field(default=None, le=MAX_LORA_LEARNING_RATE)
    """The devices' Adam learning rate. Default: the coordinator's ``LoraTuning`` (its
    ``learning_rate`` for a decoder under DP, ``plain_learning_rate`` for one without,
    ``encoder_learning_rate`` for an encoder)."""
    local_epochs: PositiveInt | None = Field(default=None, le=MAX_LORA_LOCAL_EPOCHS)
    """Epochs a device trains over its records each round. Default: the coordinator's
    ``LoraTuning`` (``local_epochs``, ``encoder_local_epochs`` for an encoder)."""
    batch_size: PositiveInt | None = Field(default=None, le=MAX_LORA_BATCH_SIZE)
    """Records a step (under DP, the expected size of each Poisson-sampled batch: epsilon grows
    with ``batch_size / records``). Default: the coordinator's ``LoraTuning`` (``batch_size``,
    ``encoder_batch_size`` for an encoder)."""


class TrainingRunRequest(FrozenModel):
    """``POST /v1/training/runs``: start a federated fine-tuning run.

    ``model`` names a served model to fine-tune (``method`` then defaults to ``lora``, which
    is the only method for a served decoder); without it the run fine-tunes the configured
    training target (``method`` ``shards``). ``rollout_every`` (optional, ``shards`` only):
    also roll a new version out after every that many rounds, not only at the end of the run.
    ``dp`` for ``lora`` is record-level DP-SGD on every device (Opacus).
    """

    rounds: PositiveInt = Field(le=MAX_API_ROUNDS)
    secure_aggregation: bool = True
    dp: bool = True
    rollout_every: PositiveInt | None = None
    model: str | None = Field(default=None, min_length=1, max_length=128)
    method: TrainingMethod | None = None
    lora: LoraOptions | None = None

    @model_validator(mode="after")
    def _check_method(self) -> Self:
        method = self.resolved_method
        if method == "lora" and self.model is None:
            raise ValueError("method lora needs the served model to fine-tune (model)")
        if method == "shards" and (self.model is not None or self.lora is not None):
            raise ValueError("a served model is fine-tuned with method lora")
        if method == "lora" and self.rollout_every is not None:
            raise ValueError("rollout_every is for method shards; a lora run rolls out at its end")
        return self

    @property
    def resolved_method(self) -> TrainingMethod:
        """``method``, or its default: ``lora`` for a served model, else ``shards``."""
        if self.method is not None:
            return self.method
        return "lora" if self.model is not None or self.lora is not None else "shards"


class TrainingRunCreated(FrozenModel):
    """The answer to ``POST /v1/training/runs``."""

    run_id: str


class RunRound(FrozenModel):
    """One finished round of a run, as the API and console show it."""

    round: PositiveInt
    loss: float | None
    """Held-out cross-entropy of the global model after the round (``lora``: token-weighted
    over the devices' held-out records, of the adapters the round started from; None when no
    device reported one: a DP round without SecAgg+ sends none)."""
    accuracy: float | None
    """Held-out accuracy of the global model after the round (``None`` for ``lora``)."""
    epsilon: float | None
    """Cumulative epsilon after the round (``None`` without differential privacy)."""
    clients: NonNegativeInt
    bytes_uploaded: NonNegativeInt
    """Model-update bytes all clients of the round sent together."""
    seconds: float = Field(ge=0)


class RunRollout(FrozenModel):
    """A version a run produced (and, where a deployment is served, rolled out live)."""

    round: PositiveInt
    directory: str
    """The name of the directory the run wrote the version's files to (``v0002``, ...)."""
    model_id: str | None = None
    version: PositiveInt | None = None
    """The served model's new version number, shown as ``MODEL vN`` (None when nothing is
    served)."""
    plan_version: PositiveInt | None = None
    """That version's plan version: the agents' key for it (None when nothing is served)."""


class RunStatus(FrozenModel):
    """``GET /v1/training/runs/{run_id}``: a run's state and the rounds finished so far."""

    run_id: str
    status: RunState
    error: str | None = None
    """Why the run failed, in plain words (``None`` unless ``status`` is ``failed``)."""
    rounds: list[RunRound] = Field(default_factory=list)
    baseline_accuracy: float | None = None
    """Held-out accuracy before the first round (once known)."""
    model_id: str | None = None
    method: TrainingMethod = "shards"
    baseline_loss: float | None = None
    """``lora``: token-weighted held-out loss of the served model on the devices, before."""
    final_loss: float | None = None
    """``lora``: token-weighted held-out loss of the final adapters on the devices."""
    trained_shard_bytes: NonNegativeInt | None = None
    """``lora``: bytes of the base weights of the segments the devices adapted."""
    epsilon_per_device: list[float] = Field(default_factory=list)
    """``lora``: each device's record-level epsilon for the run (RDP accountant)."""
    baseline_recall_at_1: float | None = Field(default=None, ge=0, le=1)
    """``lora`` of an encoder: held-out recall@1 of the served model on the devices' held-out
    pairs (pair-weighted), before."""
    final_recall_at_1: float | None = Field(default=None, ge=0, le=1)
    """``lora`` of an encoder: the same for the final adapters."""
    rollouts: list[RunRollout] = Field(default_factory=list)
    privacy_per_device: dict[str, PrivacyStatus] = Field(default_factory=dict)
    """``lora`` on paired agents: each device's privacy ledger after the run's rounds, as the
    device reports it (``GET /v1/training/privacy``): epsilon spent over every run it took part
    in (failed and rolled-back ones included) and what its budget leaves."""


class RunList(FrozenModel):
    """``GET /v1/training/runs``: every run this coordinator started, oldest first."""

    runs: list[RunStatus]


TRAINING_TARGET_FORMAT: Final = "fedshard.training-target/1"


class TrainingTargetSpec(FrozenModel):
    """``fedshard coordinator --training-target FILE``: what the coordinator's runs fine-tune.

    Relative paths are relative to the file's directory. ``method: shards`` runs: when a
    deployment serves ``model_id``, a run trains its active version's segments and rolls new
    versions out to it; otherwise it trains ``version_dir`` and only writes new version
    directories (both need ``version_dir`` and ``test_file``). ``method: lora`` runs of a served
    decoder train on local SuperNodes, one per ``text_client_data`` directory (``*.jsonl`` /
    ``*.txt`` text records).
    """

    format: Literal["fedshard.training-target/1"] = TRAINING_TARGET_FORMAT
    model_id: str = Field(min_length=1, max_length=128)
    version_dir: str | None = Field(default=None, min_length=1)
    """The version to start from (``manifest.json`` plus segment files)."""
    test_file: str | None = Field(default=None, min_length=1)
    """Held-out ``.npz`` (x, y) that stays on the coordinator."""
    client_data: list[str] = Field(default_factory=list)
    """Data directories of local SuperNodes, one each (empty: the agents bring their own)."""
    budgets: list[PositiveInt] = Field(default_factory=list)
    """Training-memory budget of each local SuperNode, in bytes."""
    text_client_data: list[str] = Field(default_factory=list)
    """Text data directories of the local SuperNodes of LoRA runs, one each."""
    text_client_cache: str | None = Field(default=None, min_length=1)
    """Where those SuperNodes keep what later runs can reuse (the frozen prefix's activations
    of their records), one sub-directory each; None: in the coordinator's state dir."""

    @model_validator(mode="after")
    def _one_budget_per_client(self) -> Self:
        if len(self.budgets) != len(self.client_data):
            raise ValueError("budgets and client_data must have the same length")
        if (self.version_dir is None) != (self.test_file is None):
            raise ValueError("version_dir and test_file go together")
        if self.version_dir is None and not self.text_client_data:
            raise ValueError("a target needs version_dir and test_file, or text_client_data")
        return self
