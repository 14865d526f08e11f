"""What a federated LoRA run records: the ServerApp's run file, and its per-round record.

The coordinator writes a :class:`LoraRunConfig` before ``flwr run``; the ServerApp
(:mod:`coordinator.training.lora.server_app`) rewrites the :class:`LoraRecord` after every round
and once more when the run ends (``finished``, or ``error`` with the reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from hostkit.files import write_atomic
from protocols.base import FrozenModel


class LoraRunConfig(FrozenModel):
    """Everything the LoRA ServerApp needs, written by the coordinator before ``flwr run``."""

    plan_file: str
    record_file: str
    weights_file: str
    rounds: PositiveInt
    secagg: bool
    num_shares: PositiveInt
    reconstruction_threshold: PositiveInt
    stage_timeout_s: PositiveFloat
    min_clients: PositiveInt
    seed: NonNegativeInt = 0


class LoraRound(FrozenModel):
    """One aggregated round, from the clients' fit metrics."""

    round: PositiveInt
    clients: NonNegativeInt
    failures: NonNegativeInt
    held_out_loss: float | None
    """Token-weighted held-out loss of the adapters the round started from (round 1: the base
    model), over the clients that reported one."""
    held_out_tokens: NonNegativeInt
    train_loss: float | None
    epsilon: dict[str, float] = Field(default_factory=dict)
    """Node id -> that device's cumulative record-level epsilon for this run."""
    upload_bytes_per_client: NonNegativeFloat
    trained_shard_bytes: NonNegativeFloat
    """Bytes of the base weights of the segments the devices adapted (largest reported)."""
    seconds: NonNegativeFloat
    held_out_recall: float | None = None
    """Encoders: pair-weighted held-out recall@1 of the adapters the round started from."""


class LoraRecord(FrozenModel):
    """The run's record on disk."""

    rounds: list[LoraRound] = Field(default_factory=list)
    final_loss: float | None = None
    """Token-weighted held-out loss of the final adapters (the last round's evaluation)."""
    final_tokens: NonNegativeInt = 0
    final_recall: float | None = None
    """Encoders: pair-weighted held-out recall@1 of the final adapters."""
    finished: bool = False
    error: str | None = None

    def save(self, path: Path) -> None:
        """Write atomically."""
        write_atomic(path, self.to_json().encode())

    @property
    def baseline_loss(self) -> float | None:
        """Held-out loss of the base model (what round 1 started from)."""
        return self.rounds[0].held_out_loss if self.rounds else None

    @property
    def baseline_recall(self) -> float | None:
        """Encoders: held-out recall@1 of the base model."""
        return self.rounds[0].held_out_recall if self.rounds else None

    @property
    def epsilon_per_device(self) -> list[float]:
        """Each device's epsilon after its last round in the run."""
        latest: dict[str, float] = {}
        for r in self.rounds:
            latest.update(r.epsilon)
        return [latest[k] for k in sorted(latest)]


def token_weighted(pairs: Sequence[tuple[float, int]]) -> tuple[float | None, int]:
    """(token-weighted mean loss, total tokens) of ``(loss, tokens)`` pairs."""
    tokens = sum(n for _, n in pairs)
    if tokens <= 0:
        return None, 0
    return sum(loss * n for loss, n in pairs) / tokens, tokens
