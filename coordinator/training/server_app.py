"""The Flower ServerApp: shard-wise FedAvg with SecAgg+ and client-level DP (legacy workflow).

``flwr run`` starts it inside the SuperLink's ``flwr-serverapp`` process; its only run-config
key, ``run-file``, names a :class:`ServerRunConfig` JSON written by the coordinator
(:mod:`coordinator.training.flower`). The app writes the :class:`TrainingRecord` after every
round and the final trainable weights (``.npz``) when the run ends.

SecAgg+ goes through ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with a
``LegacyContext``; DP through Flower's ``DifferentialPrivacyClientSideFixedClipping`` (clients run
``fixedclipping_mod``), accounted by Flower's RDP accountant after every round.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.common import ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg, Strategy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp
from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from coordinator.training.accounting import RoundAccountant
from coordinator.training.heldout import load_arrays
from coordinator.training.records import RoundMetrics, TrainingRecord, TrainingSettings
from coordinator.training.shardavg import ShardLayout
from coordinator.training.strategy import NoiseForActualClients, ShardwiseStrategy
from coordinator.training.version import HeldOutEvaluator, Version
from hostkit.files import write_atomic
from protocols.base import FrozenModel
from protocols.training import TRAIN_PLAN_KEY, TrainPlan

log = logging.getLogger(__name__)

RUN_FILE_KEY = "run-file"


class ServerRunConfig(FrozenModel):
    """Everything the ServerApp needs, written by the coordinator before ``flwr run``."""

    version_dir: str
    test_file: str
    record_file: str
    weights_file: str
    settings: TrainingSettings
    num_shares: PositiveInt
    reconstruction_threshold: PositiveInt
    stage_timeout_s: PositiveFloat
    population: NonNegativeInt
    checkpoint_every: NonNegativeInt = 0
    """Save the global weights after every that many rounds too (0: only at the end)."""


def checkpoint_path(weights_file: Path, round_number: int) -> Path:
    """Where the weights after ``round_number`` go when a run saves checkpoints."""
    return weights_file.with_name(f"{weights_file.stem}-r{round_number:04d}{weights_file.suffix}")


def save_weights(path: Path, arrays: list[np.ndarray]) -> None:
    """Final trainable arrays in wire order as ``a0, a1, ...`` (``.npz``, no pickle)."""
    buf = io.BytesIO()
    named: dict[str, Any] = {f"a{i}": a for i, a in enumerate(arrays)}
    np.savez(buf, **named)
    write_atomic(path, buf.getvalue())


def load_weights(path: Path) -> list[np.ndarray]:
    """Read what :func:`save_weights` wrote (pickle refused)."""
    with np.load(path, allow_pickle=False) as data:
        return [data[f"a{i}"] for i in range(len(data.files))]


def secagg_max_weight(settings: TrainingSettings) -> float:
    """SecAgg+'s ``max_weight``: clients scale their vector by ``weight / max_weight`` before
    quantizing to 2**22 levels over [-8, 8], so a needlessly large maximum wastes precision.
    Under DP every client weighs 1; otherwise a client holds at most this many examples."""
    dp = bool(settings.noise_multiplier) and bool(settings.clipping_norm)
    return 1.0 if dp else 1000.0


class _Recorder:
    """Keeps the run's record on disk up to date."""

    def __init__(self, path: Path, record: TrainingRecord) -> None:
        self.path = path
        self.record = record
        record.save(path)

    def add(self, metrics: RoundMetrics) -> None:
        self.record = self.record.model_copy(update={"rounds": [*self.record.rounds, metrics]})
        self.record.save(self.path)
        log.info(
            "round %d: accuracy %.4f, epsilon %s, %d clients",
            metrics.round,
            metrics.accuracy,
            metrics.epsilon,
            metrics.clients,
        )

    def finish(self) -> None:
        self.record = self.record.model_copy(update={"finished": True})
        self.record.save(self.path)


def build_strategy(
    cfg: ServerRunConfig, recorder_path: Path | None = None
) -> tuple[ShardwiseStrategy, _Recorder | None]:
    """The strategy stack for ``cfg`` (see :mod:`coordinator.training.strategy`)."""
    s = cfg.settings
    version = Version.load(Path(cfg.version_dir))
    specs = version.shard_specs(s.trainable_shards)
    dp = bool(s.noise_multiplier) and bool(s.clipping_norm)
    plan = TrainPlan(
        shards=specs,
        local_epochs=s.local_epochs,
        batch_size=s.batch_size,
        learning_rate=s.learning_rate,
        uniform_weights=dp,
    )
    plan_json = plan.model_dump_json()
    initial = version.weights(specs)
    x, y = load_arrays(Path(cfg.test_file))
    evaluator = HeldOutEvaluator(version, specs, x, y)
    inner: Strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=s.min_clients,
        min_available_clients=s.min_clients,
        min_evaluate_clients=0,
        initial_parameters=ndarrays_to_parameters(initial),
        on_fit_config_fn=lambda rnd: {TRAIN_PLAN_KEY: plan_json, "round": rnd},
    )
    accountant = None
    if dp:
        inner = NoiseForActualClients(
            inner,
            noise_multiplier=float(s.noise_multiplier or 0.0),
            clipping_norm=float(s.clipping_norm or 0.0),
            num_sampled_clients=s.min_clients,
        )
        accountant = RoundAccountant(max(cfg.population, s.min_clients), s.delta)
    recorder = None
    if recorder_path is not None:
        base_loss, base_acc = evaluator(initial)
        recorder = _Recorder(
            recorder_path,
            TrainingRecord(settings=s, baseline_accuracy=base_acc, baseline_loss=base_loss),
        )
    strategy = ShardwiseStrategy(
        inner,
        ShardLayout.from_counts([sp.index for sp in specs], [len(sp.params) for sp in specs]),
        evaluator,
        min_clients=cfg.reconstruction_threshold if s.secagg else 1,
        accountant=accountant,
        noise_multiplier=s.noise_multiplier if dp else None,
        max_examples=secagg_max_weight(cfg.settings),
        full_model_bytes=version.full_weight_bytes(),
        on_round=recorder.add if recorder is not None else None,
        on_weights=_checkpointer(cfg) if cfg.checkpoint_every else None,
    )
    return strategy, recorder


def _checkpointer(cfg: ServerRunConfig) -> Callable[[int, list[np.ndarray]], None]:
    """Saves the global weights after every ``checkpoint_every``-th round but the last."""
    every, last = cfg.checkpoint_every, cfg.settings.rounds

    def save(round_number: int, arrays: list[np.ndarray]) -> None:
        if round_number % every == 0 and round_number < last:
            save_weights(checkpoint_path(Path(cfg.weights_file), round_number), arrays)

    return save


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured rounds, recording metrics, then save the final weights."""
    cfg = ServerRunConfig.from_json(Path(str(context.run_config[RUN_FILE_KEY])).read_bytes())
    strategy, recorder = build_strategy(cfg, Path(cfg.record_file))
    legacy = LegacyContext(
        context=context,
        config=ServerConfig(num_rounds=cfg.settings.rounds),
        strategy=strategy,
    )
    if cfg.settings.secagg:
        workflow = DefaultWorkflow(
            fit_workflow=SecAggPlusWorkflow(
                num_shares=cfg.num_shares,
                reconstruction_threshold=cfg.reconstruction_threshold,
                max_weight=secagg_max_weight(cfg.settings),
                timeout=cfg.stage_timeout_s,
            )
        )
    else:
        workflow = DefaultWorkflow()
    workflow(grid, legacy)
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    final = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], True)
    save_weights(Path(cfg.weights_file), parameters_to_ndarrays(final))
    if recorder is not None:
        recorder.finish()
