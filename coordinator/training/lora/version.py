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
) -> Version:
    """Write ``out_dir``: ``parent`` with the run's adapters merged, its lineage (with epsilon
    summed over the runs of the parent's lineage), its signature."""
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
        epsilon_total=_total_epsilon(parent, epsilon),
    )
    return write_version(parent, weights, lineage, out_dir, signer)


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
