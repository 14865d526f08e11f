"""Training records: per-round metrics and the lineage stored with every trained version.

Frozen pydantic models (``protocols.base.FrozenModel``), persisted as JSON with atomic writes so
the CLI's progress bar, the API and the console can read them while a run is going.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, NonNegativeFloat, NonNegativeInt

from hostkit.files import write_atomic
from protocols.base import FrozenModel

RECORD_FORMAT = "fedshard.training/1"
LINEAGE_FORMAT = "fedshard.lineage/1"


class TrainingSettings(FrozenModel):
    """How a run was configured."""

    rounds: NonNegativeInt
    secagg: bool
    clipping_norm: NonNegativeFloat | None
    noise_multiplier: NonNegativeFloat | None
    delta: float
    trainable_shards: list[NonNegativeInt]
    local_epochs: NonNegativeInt
    learning_rate: float
    batch_size: NonNegativeInt
    min_clients: NonNegativeInt


class RoundMetrics(FrozenModel):
    """What one round produced."""

    round: NonNegativeInt
    loss: float | None = None
    """Mean training loss the clients reported (weighted like the average)."""
    test_loss: float
    accuracy: float
    """Held-out accuracy of the global model after the round."""
    epsilon: NonNegativeFloat | None = None
    """Cumulative epsilon after the round (``None`` without DP)."""
    clients: NonNegativeInt
    trained_shards: dict[str, list[NonNegativeInt]] = Field(default_factory=dict)
    """Which shards each client (by node id) trained."""
    upload_bytes_per_client: NonNegativeFloat = 0.0
    """Mean bytes of model update a client sent this round (parameter payload)."""
    full_model_bytes: NonNegativeInt = 0
    """Bytes the whole model's weights would take, for comparison."""
    seconds: NonNegativeFloat = 0.0


class TrainingRecord(FrozenModel):
    """The whole run: settings, the baseline (round 0) and each completed round."""

    format: str = RECORD_FORMAT
    settings: TrainingSettings
    baseline_accuracy: float
    baseline_loss: float
    rounds: list[RoundMetrics] = Field(default_factory=list)
    finished: bool = False

    def save(self, path: Path) -> None:
        """Write atomically as JSON."""
        write_atomic(path, self.to_json().encode())


class Lineage(FrozenModel):
    """Where a trained version came from."""

    format: str = LINEAGE_FORMAT
    parent_version: str
    parent_model_sha256: str
    trained_segments: list[NonNegativeInt]
    rounds: NonNegativeInt
    clients_per_round: list[NonNegativeInt]
    epsilon: NonNegativeFloat | None
    delta: float | None
    settings: TrainingSettings
    metrics: list[RoundMetrics]
    epsilon_per_device: dict[str, NonNegativeFloat] = Field(default_factory=dict)
    """LoRA runs: each device's record-level epsilon in this run (by SuperNode)."""
    epsilon_total: NonNegativeFloat | None = None
    """LoRA runs: the largest epsilon any training device's privacy ledger reports after this
    run (every run it took part in: failed, rolled back, other branches), or, where no device
    reported its ledger, epsilon summed over this run and every run of its ancestry. None when
    :attr:`non_dp_ancestor`."""
    non_dp_ancestor: bool = False
    """This run, a run of its ancestry, or a round in a device's ledger trained without DP: no
    finite epsilon holds (shown as "non-DP ancestor" instead of a number)."""

    @property
    def epsilon_label(self) -> str:
        """The lineage's epsilon as words: "non-DP ancestor", a number, or "-"."""
        if self.non_dp_ancestor:
            return "non-DP ancestor"
        total = self.epsilon_total if self.epsilon_total is not None else self.epsilon
        return "-" if total is None else f"{total:.3g}"
