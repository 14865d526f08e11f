"""One federated fine-tuning run, end to end on the coordinator side.

:func:`run_training` writes the app and the run file, starts the run on a running SuperLink with
``flwr run``, follows the ServerApp's record round by round until it finishes (bounded by a
timeout, or stopped by the caller), and :func:`roll_out` turns the final weights into a new
version directory. With ``checkpoint_every=k`` the ServerApp also saves the global weights after
every k-th round (:func:`~coordinator.training.server_app.checkpoint_path`) and the caller hears
of each one as soon as its round is recorded, to roll it out while the run goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.training.errors import TrainingRunError
from coordinator.training.flower import (
    SuperLink,
    start_run,
    write_app,
)
from coordinator.training.polling import follow_run
from coordinator.training.records import Lineage, RoundMetrics, TrainingRecord, TrainingSettings
from coordinator.training.rollout import Signer, next_version_dir, write_version
from coordinator.training.server_app import ServerRunConfig, checkpoint_path, load_weights
from coordinator.training.version import Version, split_by_shard
from hostkit.files import write_atomic
from protocols.errors import SchemaError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """The finished record and where the final weights are."""

    record: TrainingRecord
    weights_file: Path
    run_id: int


def secagg_parameters(clients: int) -> tuple[int, int]:
    """(num_shares, reconstruction_threshold) for ``clients``: shares with everyone, and a
    threshold that tolerates one dropout among three (about two thirds)."""
    shares = max(3, clients)
    threshold = max(2, (2 * shares + 2) // 3)
    return shares, min(threshold, shares - 1)


def run_training(
    link: SuperLink,
    work_dir: Path,
    version_dir: Path,
    test_file: Path,
    settings: TrainingSettings,
    *,
    population: int,
    stage_timeout_s: float = 120.0,
    timeout_s: float = 1800.0,
    on_round: Callable[[RoundMetrics], None] | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[TrainingRecord, Path], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> RunResult:
    """Run ``settings.rounds`` rounds on the SuperNodes connected to ``link``.

    ``on_round`` hears of every round as soon as the ServerApp records it; ``on_checkpoint``
    of every ``checkpoint_every``-th round before the last, with the record up to that round and
    the weights file saved after it. ``should_stop`` is asked about once a second; when it says
    yes the run is abandoned with :class:`TrainingRunError`.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    shares, threshold = secagg_parameters(population)
    cfg = ServerRunConfig(
        version_dir=str(version_dir.resolve()),
        test_file=str(test_file.resolve()),
        record_file=str((work_dir / "record.json").resolve()),
        weights_file=str((work_dir / "weights.npz").resolve()),
        settings=settings,
        num_shares=shares,
        reconstruction_threshold=threshold,
        stage_timeout_s=stage_timeout_s,
        population=population,
        checkpoint_every=checkpoint_every,
    )
    run_file = work_dir / "run.json"
    write_atomic(run_file, cfg.to_json().encode())
    app_dir = write_app(work_dir / "app", settings.secagg)
    record_path = Path(cfg.record_file)
    record_path.unlink(missing_ok=True)
    run_id = start_run(link, app_dir, run_file.resolve())
    log.info("run %d started", run_id)
    weights_file = Path(cfg.weights_file)
    reported = 0

    def take(record: TrainingRecord) -> RunResult | None:
        nonlocal reported
        for k, metrics in enumerate(record.rounds[reported:], start=reported + 1):
            if on_round is not None:
                on_round(metrics)
            if on_checkpoint is not None and _is_checkpoint(
                metrics.round, checkpoint_every, settings.rounds
            ):
                partial = record.model_copy(update={"rounds": record.rounds[:k]})
                on_checkpoint(partial, checkpoint_path(weights_file, metrics.round))
        reported = len(record.rounds)
        return RunResult(record, weights_file, run_id) if record.finished else None

    return follow_run(
        link,
        run_id,
        lambda: _read_record(record_path),
        take,
        timeout_s=timeout_s,
        should_stop=should_stop,
    )


def _is_checkpoint(round_number: int, every: int, rounds: int) -> bool:
    """Whether the ServerApp saved a checkpoint after ``round_number`` (never the last)."""
    return every > 0 and round_number % every == 0 and round_number < rounds


def _read_record(path: Path) -> TrainingRecord | None:
    try:
        return TrainingRecord.from_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, SchemaError) as exc:
        raise TrainingRunError(f"unreadable training record {path}: {exc}") from exc


def roll_out(
    parent: Version,
    result: RunResult,
    versions_root: Path,
    signer: Signer | None = None,
) -> Version:
    """Write the run's final weights as a new version next to ``parent`` with its lineage."""
    return write_trained_version(
        parent, result.record, result.weights_file, next_version_dir(versions_root), signer
    )


def write_trained_version(
    parent: Version,
    record: TrainingRecord,
    weights_file: Path,
    out_dir: Path,
    signer: Signer | None = None,
) -> Version:
    """Write ``weights_file`` (the trainable arrays after ``record``'s last round) into
    ``parent``'s segments as the version ``out_dir``, with the lineage of ``record``."""
    settings = record.settings
    specs = parent.shard_specs(settings.trainable_shards)
    weights = split_by_shard(specs, load_weights(weights_file))
    eps = record.rounds[-1].epsilon if record.rounds else None
    lineage = Lineage(
        parent_version=parent.name,
        parent_model_sha256=parent.manifest.model.sha256,
        trained_segments=sorted(weights),
        rounds=len(record.rounds),
        clients_per_round=[m.clients for m in record.rounds],
        epsilon=eps,
        delta=settings.delta if eps is not None else None,
        settings=settings,
        metrics=record.rounds,
    )
    return write_version(parent, weights, lineage, out_dir, signer)
