"""The real runner behind :class:`~coordinator.training.manager.TrainingRuns`: Flower, then rollout.

One run: resolve the :class:`TrainingTarget` (which version to fine-tune, its held-out set, the
local SuperNodes to start if any, the served deployment to update), start a SuperLink (and those
SuperNodes), run the ServerApp through ``flwr run`` with per-round metrics streamed to the
reporter, and write a new version after the run (and after every ``rollout_every`` rounds). When
the target names a served deployment, each new version is rolled out to it live through the
deployer (loaded beside the live version, health-checked, then switched to).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from coordinator.deploy.store import VersionRecord, version_label
from coordinator.errors import CoordinatorError
from coordinator.training.driver import run_training, write_trained_version
from coordinator.training.errors import RolloutError, TrainingRunError
from coordinator.training.flower import (
    HOST,
    SuperLink,
    make_node_key,
    register_supernode,
    superlink,
    unregister_supernode,
)
from coordinator.training.local_agents import start_local_agents
from coordinator.training.manager import RunReporter
from coordinator.training.records import RoundMetrics, TrainingRecord, TrainingSettings
from coordinator.training.revoked_nodes import RevokedNodes, unregistering_revoked
from coordinator.training.rollout import next_version_dir
from coordinator.training.segments import trainable_names
from coordinator.training.version import Version
from coordinator.trust.ca import CertificateAuthority
from hostkit.files import write_atomic
from protocols.errors import SchemaError
from protocols.training import RunRollout, RunRound, TrainingRunRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingTarget:
    """What a run fine-tunes and where its results go."""

    version_dir: Path
    """The version to start from (``manifest.json`` plus segment files)."""
    test_file: Path
    """Held-out ``.npz`` (x, y) that stays on the coordinator."""
    versions_root: Path
    """Where the run's new versions are written (``vNNNN`` directories)."""
    population: int
    """Clients every round waits for."""
    data_dirs: tuple[Path, ...] = ()
    """Local SuperNodes to start, one per data dir (empty: agents connect their own)."""
    budgets: tuple[int, ...] = ()
    """Training-memory budgets of those local SuperNodes."""
    model_id: str | None = None
    """The served deployment whose version this is; new versions are rolled out to it."""


@dataclass(frozen=True)
class RunnerSettings:
    """Fixed training settings of the runs (the API chooses rounds, SecAgg+ and DP)."""

    clipping_norm: float = 1.0
    noise_multiplier: float = 0.05
    delta: float = 1e-5
    local_epochs: int = 2
    learning_rate: float = 0.003
    batch_size: int = 32
    timeout_s: float = 1800.0
    stage_timeout_s: float = 120.0
    superlink_port: int = 0
    """0: a free port per run."""


Federation = Callable[[Path, TrainingTarget], AbstractContextManager[SuperLink]]
"""Starts the SuperLink (and local SuperNodes) of a run under a directory; stops them on exit."""
Publish = Callable[[str, Version], VersionRecord]
"""Rolls a version out to a served deployment (model id); returns the version now served."""


def served_as(served: VersionRecord | None) -> str:
    """``, served as MODEL vN`` for a version rolled out (empty when nothing is served)."""
    return f", served as {version_label(served)}" if served is not None else ""


def default_shards(version: Version, count: int = 2) -> list[int]:
    """The last ``count`` segments that have weights to train."""
    weighted = [i for i, seg in enumerate(version.segments) if trainable_names(seg)]
    if not weighted:
        raise TrainingRunError(f"version {version.name} has no weights to train")
    return weighted[-count:]


def training_settings(
    request: TrainingRunRequest, parent: Version, target: TrainingTarget, fixed: RunnerSettings
) -> TrainingSettings:
    """The run's :class:`TrainingSettings` from the API request and the fixed settings."""
    if request.secure_aggregation and target.population < 3:
        raise TrainingRunError("secure aggregation needs at least 3 clients")
    return TrainingSettings(
        rounds=request.rounds,
        secagg=request.secure_aggregation,
        clipping_norm=fixed.clipping_norm if request.dp else None,
        noise_multiplier=fixed.noise_multiplier if request.dp else None,
        delta=fixed.delta,
        trainable_shards=default_shards(parent),
        local_epochs=fixed.local_epochs,
        learning_rate=fixed.learning_rate,
        batch_size=fixed.batch_size,
        min_clients=target.population,
    )


def run_round(metrics: RoundMetrics) -> RunRound:
    """A recorded round as the API shows it (loss: held-out; bytes: all clients together)."""
    return RunRound(
        round=metrics.round,
        loss=metrics.test_loss,
        accuracy=metrics.accuracy,
        epsilon=metrics.epsilon,
        clients=metrics.clients,
        bytes_uploaded=round(metrics.upload_bytes_per_client * metrics.clients),
        seconds=metrics.seconds,
    )


@contextmanager
def authenticated_superlink(
    run_dir: Path, ca: CertificateAuthority, nodes: int, port: int = 0
) -> Iterator[tuple[SuperLink, list[Path]]]:
    """A SuperLink with node authentication and ``nodes`` fresh node keys registered with it:
    (the SuperLink, the private key files for the local SuperNodes, one each)."""
    with superlink(run_dir, ca, node_auth=True, port=port) as link:
        keys = []
        for i in range(nodes):
            private, public = make_node_key(run_dir / f"agent-{i}" / "node-key")
            register_supernode(link, public)
            keys.append(private)
        yield link, keys


def local_federation(ca: CertificateAuthority, port: int = 0) -> Federation:
    """A SuperLink on 127.0.0.1 with node authentication, plus one local SuperNode per data dir
    of the target, each with its own registered key."""

    @contextmanager
    def start(run_dir: Path, target: TrainingTarget) -> Iterator[SuperLink]:
        if not target.data_dirs:
            raise TrainingRunError(
                "the training target lists no client_data and no agents train here: start the "
                "coordinator with --superlink-port so that the paired agents' SuperNodes join"
            )
        with ExitStack() as stack:
            link, keys = stack.enter_context(
                authenticated_superlink(run_dir, ca, len(target.data_dirs), port)
            )
            stack.enter_context(
                start_local_agents(
                    link, target.version_dir, target.data_dirs, target.budgets, run_dir, keys
                )
            )
            yield link

    return start


@contextmanager
def paired_superlink(
    run_dir: Path,
    ca: CertificateAuthority,
    node_keys: Mapping[str, str],
    clients: int,
    port: int = 0,
    host: str = HOST,
    current: Callable[[], Mapping[str, str]] | None = None,
) -> Iterator[SuperLink]:
    """A SuperLink on ``host:port`` that admits only the SuperNodes of ``node_keys``.

    Node authentication is on; every key (device name to OpenSSH public key, as sent with the
    pairing request) is registered before the SuperLink is handed out. Agents' SuperNodes
    (``fedshard agent --train-superlink HOST:PORT``) are refused until their key is registered,
    and restart until they get in. Fewer keys than ``clients`` is a :class:`TrainingRunError`.
    With ``current`` (the pairing book's node keys now), a device revoked while the SuperLink
    runs has its SuperNode unregistered (:mod:`coordinator.training.revoked_nodes`).
    """
    if len(node_keys) < clients:
        raise TrainingRunError(
            f"{len(node_keys)} paired agents have a node key; the run needs {clients}"
        )
    with superlink(run_dir, ca, node_auth=True, port=port, host=host) as link:
        registered = {}
        for name, key in sorted(node_keys.items()):
            path = run_dir / "node-keys" / f"{name}.pub"
            write_atomic(path, f"{key}\n".encode())
            registered[name] = (key, register_supernode(link, path))
            log.info("registered the node key of %s", name)
        if current is None:
            yield link
            return
        nodes = RevokedNodes(registered, current, partial(unregister_supernode, link))
        with unregistering_revoked(nodes):
            yield link


def agent_federation(
    ca: CertificateAuthority,
    port: int,
    node_keys: Callable[[], Mapping[str, str]],
    host: str = HOST,
) -> Federation:
    """Runs on the paired agents: a :func:`paired_superlink` with the keys paired right now."""

    @contextmanager
    def start(run_dir: Path, target: TrainingTarget) -> Iterator[SuperLink]:
        keys = dict(node_keys())
        with paired_superlink(
            run_dir, ca, keys, target.population, port, host, current=node_keys
        ) as link:
            yield link

    return start


class Follower:
    """Turns the run's rounds into reports, and checkpoints into versions (and rollouts)."""

    def __init__(
        self,
        parent: Version,
        target: TrainingTarget,
        report: RunReporter,
        publish: Publish | None,
        signer: CertificateAuthority | None,
        record_file: Path,
    ) -> None:
        self.current = parent
        self.target = target
        self.report = report
        self.publish = publish
        self.signer = signer
        self.record_file = record_file
        self.baseline_sent = False

    def round(self, metrics: RoundMetrics) -> None:
        """Report a finished round (with the baseline accuracy before the first)."""
        if not self.baseline_sent:
            self.baseline_sent = True
            self.report.running(self._baseline())
        self.report.round(run_round(metrics))

    def checkpoint(self, record: TrainingRecord, weights_file: Path) -> None:
        """Write (and roll out) the version of ``record``'s rounds from ``weights_file``."""
        out_dir = next_version_dir(self.target.versions_root)
        version = write_trained_version(self.current, record, weights_file, out_dir, self.signer)
        self.current = version
        served = None
        model_id = self.target.model_id
        if model_id is not None and self.publish is not None:
            try:
                served = self.publish(model_id, version)
            except CoordinatorError as exc:
                raise RolloutError(
                    f"rolling {version.name} out to {model_id} failed: {exc}"
                ) from exc
        last = record.rounds[-1].round
        log.info("round %d: wrote %s%s", last, version.path, served_as(served))
        self.report.rollout(
            RunRollout(
                round=last,
                directory=version.name,
                model_id=model_id,
                version=served.version if served is not None else None,
                plan_version=served.plan_version if served is not None else None,
            )
        )

    def _baseline(self) -> float | None:
        try:
            return TrainingRecord.from_json(self.record_file.read_bytes()).baseline_accuracy
        except (OSError, SchemaError) as exc:
            log.warning("no baseline accuracy: %s", exc)
            return None


class FlowerRunner:
    """Runs a :class:`TrainingRunRequest` with real Flower processes, then rolls out."""

    def __init__(
        self,
        work_dir: Path,
        ca: CertificateAuthority,
        target: Callable[[], TrainingTarget],
        settings: RunnerSettings | None = None,
        publish: Publish | None = None,
        federation: Federation | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.ca = ca
        self.target = target
        self.settings = settings or RunnerSettings()
        self.publish = publish
        self.federation = federation or local_federation(ca, self.settings.superlink_port)

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        """One run, blocking (see the module doc)."""
        target = self.target()
        parent = Version.load(target.version_dir)
        settings = training_settings(request, parent, target, self.settings)
        run_dir = self.work_dir / "runs" / run_id
        follower = Follower(
            parent, target, report, self.publish, self.ca, (run_dir / "record.json").resolve()
        )
        with self.federation(run_dir, target) as link:
            report.running()
            result = run_training(
                link,
                run_dir,
                target.version_dir,
                target.test_file,
                settings,
                population=target.population,
                stage_timeout_s=self.settings.stage_timeout_s,
                timeout_s=self.settings.timeout_s,
                on_round=follower.round,
                checkpoint_every=request.rollout_every or 0,
                on_checkpoint=follower.checkpoint,
                should_stop=stop.is_set,
            )
        follower.checkpoint(result.record, result.weights_file)
