"""A finished LoRA run becomes a new signed version: adapters merged into the initializers.

Only the segments holding an adapted layer get new files; every other segment file is copied
byte for byte (:func:`coordinator.training.rollout.write_version`), and the manifest is signed
with the coordinator's CA. The lineage records the run's rounds, clients and the largest
per-device record-level epsilon.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from coordinator.training.records import Lineage, TrainingSettings
from coordinator.training.rollout import Signer, write_version
from coordinator.training.version import LINEAGE_FILE, Version
from partitioner.models.lora import adapters_by_module, merged_by_segment
from protocols.errors import SchemaError
from protocols.lora import LoraPlan


def lora_weights(
    parent: Version, plan: LoraPlan, arrays: Sequence[np.ndarray]
) -> dict[int, dict[str, np.ndarray]]:
    """``{segment index: {initializer: merged array}}`` for the segments the adapters change."""
    adapters = adapters_by_module(plan.adapters, arrays)
    trainable = [parent.segments[i] for i in plan.trainable]
    merged = merged_by_segment(trainable, adapters, plan.weight_map, plan.lora.scale)
    return {plan.trainable[k]: weights for k, weights in merged.items()}


def write_lora_version(
    parent: Version,
    plan: LoraPlan,
    arrays: Sequence[np.ndarray],
    out_dir: Path,
    *,
    rounds: int,
    clients_per_round: list[int],
    epsilon: float | None,
    signer: Signer | None = None,
    epsilon_per_device: dict[str, float] | None = None,
    ledger_epsilon: float | None = None,
    ledger_non_dp: bool = False,
) -> Version:
    """Write ``out_dir``: ``parent`` with the run's adapters merged, its lineage, its signature.
    The lineage's total epsilon is ``ledger_epsilon`` (the largest the devices' privacy ledgers
    report) when given, else summed over the runs of the parent's lineage; a run without DP, a
    parent lineage with one, or ``ledger_non_dp`` (a device's ledger holds a round without DP)
    makes it "non-DP ancestor" instead."""
    weights = lora_weights(parent, plan, arrays)
    dp = plan.dp
    settings = TrainingSettings(
        rounds=rounds,
        secagg=False,
        clipping_norm=dp.max_grad_norm if dp else None,
        noise_multiplier=dp.noise_multiplier if dp else None,
        delta=dp.delta if dp else 1e-5,
        trainable_shards=sorted(weights),
        local_epochs=plan.local_epochs,
        learning_rate=plan.learning_rate,
        batch_size=plan.batch_size,
        min_clients=min(clients_per_round, default=0),
    )
    non_dp = epsilon is None or ledger_non_dp or _non_dp_lineage(parent)
    lineage = Lineage(
        parent_version=parent.name,
        parent_model_sha256=parent.manifest.model.sha256,
        trained_segments=sorted(weights),
        rounds=rounds,
        clients_per_round=clients_per_round,
        epsilon=epsilon,
        delta=dp.delta if dp and epsilon is not None else None,
        settings=settings,
        metrics=[],
        epsilon_per_device=epsilon_per_device or {},
        epsilon_total=None if non_dp else _lineage_total(parent, epsilon, ledger_epsilon),
        non_dp_ancestor=non_dp,
    )
    return write_version(parent, weights, lineage, out_dir, signer)


def _lineage_total(parent: Version, epsilon: float | None, ledger: float | None) -> float | None:
    """The devices' ledgers' epsilon when reported, else the sum over the lineage's runs."""
    return ledger if ledger is not None else _total_epsilon(parent, epsilon)


def _non_dp_lineage(parent: Version) -> bool:
    """Whether ``parent`` was trained without DP, or descends from a version that was (a
    version no run wrote, such as the first deployed one, is not)."""
    try:
        prior = Lineage.from_json((parent.path / LINEAGE_FILE).read_bytes())
    except FileNotFoundError:
        return False
    except (OSError, SchemaError):
        return True  # an unreadable lineage cannot show its runs were private
    return prior.non_dp_ancestor or prior.epsilon is None


def _total_epsilon(parent: Version, epsilon: float | None) -> float | None:
    """This run's epsilon plus the parent's lineage total (a version no run wrote adds 0)."""
    if epsilon is None:
        return None
    try:
        prior = Lineage.from_json((parent.path / LINEAGE_FILE).read_bytes())
    except (OSError, SchemaError):
        return epsilon
    before = prior.epsilon_total if prior.epsilon_total is not None else prior.epsilon
    return epsilon + (before or 0.0)
