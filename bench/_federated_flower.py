"""The SecAgg+ rows of ``bench/federated.py``: the same LoRA plan and WordNet shares, through
real Flower (the product's federation, not new plumbing).

A ``flower-superlink`` with SuperNode authentication and three authenticated local SuperNodes
(:func:`coordinator.training.lora.target.local_lora_federation`), one per WordNet share, and
``flwr run`` of :mod:`coordinator.training.lora.server_app` with SecAgg+ over the adapter
updates (:func:`coordinator.training.lora.runner.start_lora_run`), followed through its record
(:func:`coordinator.training.lora.runner.follow`). Nothing is merged or rolled out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.training.lora.records import LoraRecord
from devtools.lora_lab import DOMAINS, LoraSetup
from protocols.lora import LoraPlan

POPULATION = len(DOMAINS)


@dataclass(frozen=True)
class FlowerRun:
    """What one real-Flower run measured (from the ServerApp's record)."""

    loss: list[float]
    """Held-out loss before round 1, then after each round (token-weighted over devices)."""
    round_s: list[float]
    upload_bytes: float
    """Mean per client per round: the adapter arrays the client reports (float32)."""
    masked_bytes: float
    """Per client per round: the SecAgg+-masked vector as Flower serializes it."""
    trained_bytes: float
    epsilon: list[float]
    """Per round: the largest device's cumulative epsilon (empty without DP)."""


def masked_vector_bytes(plan: LoraPlan) -> int:
    """Bytes of the masked vector a SecAgg+ client uploads for ``plan``'s adapters: Flower's
    ``secaggplus_mod`` quantizes, masks and sends each array as int64 (``ndarray_to_bytes``)."""
    from flwr.common import ndarray_to_bytes

    from partitioner.models.lora import initial_adapters

    arrays = initial_adapters(plan.adapters, plan.lora.rank, seed=0)
    return sum(len(ndarray_to_bytes(np.zeros(a.shape, np.int64))) for a in arrays)


def run_flower(
    setup: LoraSetup, work: Path, rounds: int, per_device: int, seed: int, model_id: str
) -> FlowerRun:
    """One SecAgg+ run of ``setup.plan`` (of decoder ``model_id``) on three local SuperNodes
    (see the module doc)."""
    from coordinator.training.lora.runner import LoraTarget, follow, stage_segments, start_lora_run
    from coordinator.training.lora.target import local_lora_federation
    from coordinator.trust.ca import CertificateAuthority
    from devtools.wordnet import write_shares
    from protocols.training import TrainingRunRequest

    dirs = write_shares(work / "data", DOMAINS, per_device=per_device)
    run_dir = work / "run"
    tokenizer = setup.version_dir / "tokenizer.json"
    segments = stage_segments(setup.version_dir, tokenizer, run_dir / "segments")
    target = LoraTarget(
        model_id=model_id, version_dir=setup.version_dir, model_file=Path("unused"),
        tokenizer_file=tokenizer, versions_root=work / "versions", population=POPULATION,
        data_dirs=tuple(dirs), budgets=tuple(1 << 30 for _ in dirs),
    )  # fmt: skip
    request = TrainingRunRequest(rounds=rounds, model=model_id, method="lora")
    federation = local_lora_federation(CertificateAuthority.open(work / "ca"))
    with federation(run_dir, segments, target) as link:
        cfg, flower_run = start_lora_run(
            link, run_dir, setup.plan, request, POPULATION, 600.0, seed=seed
        )
        record = follow(
            link, Path(cfg.record_file), lambda _: None, 1800.0, lambda: False, flower_run
        )
    return measured(record, setup.plan)


def measured(record: LoraRecord, plan: LoraPlan) -> FlowerRun:
    """The bench's numbers from a finished run's record."""
    loss = [float(r.held_out_loss or 0.0) for r in record.rounds]
    return FlowerRun(
        loss=[*loss, float(record.final_loss or 0.0)],
        round_s=[r.seconds for r in record.rounds],
        upload_bytes=float(np.mean([r.upload_bytes_per_client for r in record.rounds])),
        masked_bytes=float(masked_vector_bytes(plan)),
        trained_bytes=max(r.trained_shard_bytes for r in record.rounds),
        epsilon=[max(r.epsilon.values()) for r in record.rounds if r.epsilon],
    )
