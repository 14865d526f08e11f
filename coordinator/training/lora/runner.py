"""A federated LoRA run of a served decoder, end to end on the coordinator side.

1. Plan: the served version's segments and the decoder's :class:`~.plan.LoraBase` give
   the :class:`~protocols.lora.LoraPlan` (:func:`~.plan.build_plan`).
2. Federation: a SuperLink with SuperNode authentication (and the local SuperNodes of the
   target, each with its own registered key); ``flwr run`` of
   :mod:`coordinator.training.lora.server_app`, whose record is followed round by round.
3. A run that ends without an aggregate (or with an error) fails with the reason; nothing is
   written or rolled out. So does a run whose training diverged (:func:`check_converged`:
   adapters not finite): merged, its NaNs would pass the deploy's
   health check, which compares the chain with the version's own outputs.
4. The final adapters are merged (:func:`~.version.write_lora_version`) into a new signed
   version, which also carries the whole merged model (so a failover can re-plan it), its
   ``decoder.json``, tokenizer and :data:`~.plan.LORA_BASE_FILE`; the publisher verifies
   the signature and rolls it out live.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.deploy.store import VersionRecord
from coordinator.errors import CoordinatorError
from coordinator.training.driver import secagg_parameters
from coordinator.training.errors import DivergedError, RolloutError, TrainingRunError
from coordinator.training.flower import SuperLink, start_run, write_app
from coordinator.training.lora.plan import (
    LoraBase,
    LoraTuning,
    admit_options,
    build_plan,
    lora_base,
)
from coordinator.training.lora.records import LoraRecord, LoraRunConfig
from coordinator.training.lora.version import write_lora_version
from coordinator.training.manager import LoraSummary, RunReporter
from coordinator.training.polling import follow_run
from coordinator.training.rollout import next_version_dir
from coordinator.training.server_app import load_weights
from coordinator.training.version import MANIFEST_FILE, Version
from coordinator.trust.ca import CertificateAuthority
from hostkit.files import write_atomic
from protocols.decoder import TOKENIZER_FILE
from protocols.errors import SchemaError
from protocols.ledger import PrivacyStatus, RunFate
from protocols.lora import LoraPlan
from protocols.manifest import Manifest
from protocols.training import RunRollout, RunRound, TrainingRunRequest

log = logging.getLogger(__name__)

LORA_SERVER_MODULE = "coordinator.training.lora.server_app"
LORA_BASE_CACHE = "lora-base"
"""Folder of the model cache (``$FEDSHARD_CACHE``) holding LoRA bases by model sha256: a base is
derived from the model file alone, so it outlives the coordinator's state (building Gemma 3
270M's takes about 20 s)."""


@dataclass(frozen=True)
class LoraTarget:
    """The served decoder a LoRA run fine-tunes, and where its results go."""

    model_id: str
    version_dir: Path
    """The served version's segments (``manifest.json`` plus segment files)."""
    model_file: Path
    """The whole model the served version was cut from (``decoder.json`` beside it)."""
    tokenizer_file: Path
    versions_root: Path
    population: int
    data_dirs: tuple[Path, ...] = ()
    """Local SuperNodes to start, one per text data dir (empty: agents connect their own)."""
    budgets: tuple[int, ...] = ()
    cache_root: Path | None = None
    """Where the local SuperNodes keep what later runs reuse (``agent-I`` each); None: in the
    run's own directory."""


LoraFederation = Callable[[Path, Path, LoraTarget], AbstractContextManager[SuperLink]]
"""Starts the SuperLink (and SuperNodes on the staged segments dir) of a run; stops them."""
Publish = Callable[[str, Version], VersionRecord]


def stage_segments(version_dir: Path, tokenizer_file: Path, out: Path) -> Path:
    """The segments dir the run's SuperNodes read: the served version's manifest and segments
    (hard links where possible) and the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = (version_dir / MANIFEST_FILE).read_bytes()
    for entry in Manifest.from_json(manifest).segments:
        _link_or_copy(version_dir / entry.file, out / entry.file)
    write_atomic(out / MANIFEST_FILE, manifest)
    _link_or_copy(tokenizer_file, out / TOKENIZER_FILE)
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def follow(
    link: SuperLink,
    record_path: Path,
    on_update: Callable[[LoraRecord], None],
    timeout_s: float,
    should_stop: Callable[[], bool],
    run_id: int | None = None,
) -> LoraRecord:
    """Poll the ServerApp's record until it is finished; raise with the reason otherwise."""

    def take(record: LoraRecord) -> LoraRecord | None:
        on_update(record)
        if record.error is not None:
            raise TrainingRunError(record.error)
        return record if record.finished else None

    return follow_run(
        link, run_id, lambda: _read(record_path), take, timeout_s=timeout_s,
        should_stop=should_stop,
    )  # fmt: skip


def _read(path: Path) -> LoraRecord | None:
    try:
        return LoraRecord.from_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, SchemaError) as exc:
        raise TrainingRunError(f"unreadable LoRA record {path}: {exc}") from exc


def run_round(record: LoraRecord, k: int) -> RunRound:
    """Round ``k`` (0-based) as the API shows it: the held-out loss after it (the next round's
    starting loss, or the final evaluation after the last), summed upload, largest epsilon."""
    r = record.rounds[k]
    after = record.rounds[k + 1].held_out_loss if k + 1 < len(record.rounds) else None
    loss = after if after is not None else record.final_loss
    return RunRound(
        round=r.round,
        loss=loss if loss is not None else r.held_out_loss,
        accuracy=None,
        epsilon=max(r.epsilon.values()) if r.epsilon else None,
        clients=r.clients,
        bytes_uploaded=round(r.upload_bytes_per_client * r.clients),
        seconds=r.seconds,
    )


def start_lora_run(
    link: SuperLink, run_dir: Path, plan: LoraPlan, request: TrainingRunRequest, population: int,
    stage_timeout_s: float, seed: int = 0,
) -> tuple[LoraRunConfig, int]:  # fmt: skip
    """Write the plan and run file, ``flwr run`` the LoRA ServerApp; the run file's config and
    the Flower run id. ``seed`` picks the round-one adapters."""
    shares, threshold = secagg_parameters(population)
    plan_file = run_dir / "plan.json"
    write_atomic(plan_file, plan.to_json().encode())
    cfg = LoraRunConfig(
        plan_file=str(plan_file.resolve()),
        record_file=str((run_dir / "record.json").resolve()),
        weights_file=str((run_dir / "adapters.npz").resolve()),
        rounds=request.rounds,
        secagg=request.secure_aggregation,
        num_shares=shares,
        reconstruction_threshold=threshold,
        stage_timeout_s=stage_timeout_s,
        min_clients=population,
        seed=seed,
    )
    run_file = run_dir / "run.json"
    write_atomic(run_file, cfg.to_json().encode())
    Path(cfg.record_file).unlink(missing_ok=True)
    app = write_app(run_dir / "app", request.secure_aggregation, LORA_SERVER_MODULE)
    run_id = start_run(link, app, run_file.resolve())
    log.info("LoRA run %d started (%d adapters)", run_id, len(plan.adapters))
    return cfg, run_id


def check_converged(record: LoraRecord, arrays: list[np.ndarray]) -> None:
    """Raise :class:`DivergedError` when the run's final adapters are not finite (the
    training diverged): such a run is not merged or rolled out. (A record cannot hold a loss
    that is not finite.)"""
    bad = [i for i, a in enumerate(arrays) if not np.isfinite(a).all()]
    if bad:
        raise DivergedError(
            f"the training diverged ({len(bad)} of {len(arrays)} adapter arrays not finite, "
            f"final held-out loss {record.final_loss}); nothing was rolled out"
        )


def with_fate(
    run_id: str, mark: Callable[[str, RunFate], None] | None, body: Callable[[], None]
) -> None:
    """Run ``body`` (a run's rounds and rollout), then ``mark`` the run in the devices' ledgers:
    rolled out, diverged (:class:`DivergedError`) or failed (any other exception, re-raised)."""
    try:
        body()
    except DivergedError:
        if mark is not None:
            mark(run_id, RunFate.DIVERGED)
        raise
    except Exception:
        if mark is not None:
            mark(run_id, RunFate.FAILED)
        raise
    if mark is not None:
        mark(run_id, RunFate.ROLLED_OUT)


class _RoundReports:
    """Reports each round once its after-loss is known (the next round's, or the final one)."""

    def __init__(self, report: RunReporter) -> None:
        self.report = report
        self.sent = 0

    def update(self, record: LoraRecord) -> None:
        ready = len(record.rounds) if record.finished else len(record.rounds) - 1
        for k in range(self.sent, max(ready, 0)):
            self.report.round(run_round(record, k))
        self.sent = max(self.sent, ready)


class LoraRunner:
    """Runs a ``method: lora`` :class:`TrainingRunRequest` (see the module doc)."""

    def __init__(
        self,
        work_dir: Path,
        ca: CertificateAuthority,
        resolve: Callable[[str], LoraTarget],
        federation: LoraFederation,
        publish: Publish | None,
        model_cache: Path,
        tuning: LoraTuning | None = None,
        timeout_s: float = 3600.0,
        stage_timeout_s: float = 600.0,
        privacy: Callable[[], dict[str, PrivacyStatus]] | None = None,
        mark_run: Callable[[str, RunFate], None] | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.privacy = privacy
        """Reads the training devices' privacy ledgers (paired agents; None: local SuperNodes,
        which keep none)."""
        self.mark_run = mark_run
        """Tells the training devices' ledgers what became of a run (paired agents)."""
        self.ca = ca
        self.resolve = resolve
        self.federation = federation
        self.publish = publish
        self.model_cache = model_cache
        self.tuning = tuning or LoraTuning()
        self.timeout_s = timeout_s
        self.stage_timeout_s = stage_timeout_s

    def admit(self, request: TrainingRunRequest) -> None:
        """Raise (404, 400) when ``request`` cannot start: its model is not served or cannot be
        fine-tuned, or its LoRA options do not fit the model (:func:`admit_options`)."""
        target = self.resolve(str(request.model))
        admit_options(request.lora, target.model_file)

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        """One run, blocking."""
        if request.model is None:
            raise TrainingRunError("a LoRA run needs a served model")
        target = self.resolve(request.model)
        if request.secure_aggregation and target.population < 3:
            raise TrainingRunError("secure aggregation needs at least 3 clients")
        base = lora_base(target.model_file, self.model_cache / LORA_BASE_CACHE, self.model_cache)
        plan = build_plan(
            run_id, target.version_dir, target.tokenizer_file, base, request.lora, request.dp,
            self.tuning,
        )  # fmt: skip
        with_fate(
            run_id, self.mark_run,
            lambda: self._federated(run_id, request, target, base, plan, report, stop),
        )  # fmt: skip

    def _federated(
        self, run_id: str, request: TrainingRunRequest, target: LoraTarget, base: LoraBase,
        plan: LoraPlan, report: RunReporter, stop: threading.Event,
    ) -> None:  # fmt: skip
        """The rounds, the summary and the rollout of a planned run."""
        run_dir = self.work_dir / "runs" / run_id
        segments = stage_segments(target.version_dir, target.tokenizer_file, run_dir / "segments")
        rounds = _RoundReports(report)
        with self.federation(run_dir, segments, target) as link:
            report.running(None)
            cfg, flower_run = start_lora_run(
                link, run_dir, plan, request, target.population, self.stage_timeout_s
            )
            record = follow(link, Path(cfg.record_file), rounds.update, self.timeout_s,
                            stop.is_set, flower_run)  # fmt: skip
        rounds.update(record)
        privacy = self.privacy() if self.privacy is not None else {}
        trained = max((r.trained_shard_bytes for r in record.rounds), default=None)
        report.summary(
            LoraSummary(
                baseline_loss=record.baseline_loss,
                final_loss=record.final_loss,
                epsilon_per_device=record.epsilon_per_device,
                trained_shard_bytes=None if trained is None else round(trained),
                baseline_recall=record.baseline_recall,
                final_recall=record.final_recall,
                privacy=privacy,
            )
        )
        arrays = load_weights(Path(cfg.weights_file))
        check_converged(record, arrays)
        self.roll_out(target, plan, base, record, arrays, report, privacy)

    def roll_out(
        self,
        target: LoraTarget,
        plan: LoraPlan,
        base: LoraBase,
        record: LoraRecord,
        arrays: list[np.ndarray],
        report: RunReporter,
        privacy: dict[str, PrivacyStatus] | None = None,
    ) -> None:
        """Merge, sign, and roll the new version out (see the module doc); the lineage's
        epsilon is read from the devices' ``privacy`` ledgers when they reported them."""
        from coordinator.training.lora.whole import write_whole_model

        parent = Version.load(target.version_dir)
        out = next_version_dir(target.versions_root)
        eps = record.epsilon_per_device
        version = write_lora_version(
            parent, plan, arrays, out, rounds=len(record.rounds),
            clients_per_round=[r.clients for r in record.rounds],
            epsilon=max(eps) if eps else None, signer=self.ca,
            epsilon_per_device=record.rounds[-1].epsilon if record.rounds else None,
            ledger_epsilon=max((p.epsilon_spent for p in (privacy or {}).values()), default=None),
            ledger_non_dp=any(p.non_dp_rounds for p in (privacy or {}).values()),
        )  # fmt: skip
        write_whole_model(target.model_file, plan, base, arrays, out)
        served = None
        if self.publish is not None:
            try:
                served = self.publish(target.model_id, version)
            except CoordinatorError as exc:
                raise RolloutError(
                    f"rolling {version.name} out to {target.model_id} failed: {exc}"
                ) from exc
        report.rollout(
            RunRollout(
                round=len(record.rounds),
                directory=version.name,
                model_id=target.model_id,
                version=served.version if served is not None else None,
                plan_version=served.plan_version if served is not None else None,
            )
        )
