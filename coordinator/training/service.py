"""The coordinator's training runs: the reference task, trained live on its served deployment.

``fedshard coordinator`` builds :func:`coordinator_runs` once. A run (``POST /v1/training/runs``)
fine-tunes the reference digits CNN (:mod:`coordinator.training.task`, prepared once under the
state dir) with one local SuperNode per non-IID data split, or, when the coordinator was given
``--superlink-port`` (:class:`PairedAgents`), with the paired agents' own SuperNodes: a
SuperLink with node authentication admits exactly the keys they sent when they paired.

When the model is served under :data:`REFERENCE_MODEL_ID` (deploy
``STATE/training/task/digits-cnn.onnx`` with that id), the run trains the served version's own
segments and rolls each new version out to it live; otherwise it trains the task's offline
version and only writes new version directories.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from coordinator.ca import CertificateAuthority
from coordinator.config import AgentTrainingConfig
from coordinator.deployer import Deployer
from coordinator.deployments import DeploymentStore
from coordinator.errors import NotServableError, UnknownModelError
from coordinator.training.runner import (
    FlowerRunner,
    RunnerSettings,
    TrainingTarget,
    agent_federation,
)
from coordinator.training.runs import TrainingRuns
from coordinator.training.version import Version

log = logging.getLogger(__name__)

REFERENCE_MODEL_ID = "digits-cnn"
LOCAL_BUDGETS = (50_000, 1 << 30, 1 << 30)
"""The first local device fits only the head shard's training; the others fit more."""
READY_FILE = "ready"
SAMPLE_ROWS = 8
"""Held-out rows used as warm-up and health-check inputs of a live rollout."""


def reference_task_dir(state_dir: Path) -> Path:
    """Where the reference task lives under the coordinator's state dir."""
    return state_dir / "training" / "task"


def prepared_task(root: Path) -> tuple[Path, Path, list[Path]]:
    """(first version, held-out file, client data dirs) of the reference task, built once."""
    from coordinator.training.task import TEST_FILE, prepare_task

    if not (root / READY_FILE).is_file():
        task = prepare_task(root, num_clients=len(LOCAL_BUDGETS))
        (root / READY_FILE).write_text("prepared\n")
        return task.version_dir, task.test_file, task.client_dirs
    clients = [root / "clients" / str(i) for i in range(len(LOCAL_BUDGETS))]
    return root / "versions" / "v0001", root / TEST_FILE, clients


class LivePublisher:
    """Rolls a trained version out to a served deployment through the deployer."""

    def __init__(
        self,
        deployer: Deployer,
        store: DeploymentStore,
        test_file: Path,
        ca_cert_pem: bytes | None = None,
    ) -> None:
        self.deployer = deployer
        self.store = store
        self.test_file = test_file
        self.ca_cert_pem = ca_cert_pem
        """When set, a version's manifest signature must verify before it is deployed."""

    def __call__(self, model_id: str, version: Version) -> int:
        """Verify ``version``'s signature, deploy it beside the live one, health-check it,
        switch; the plan version."""
        from coordinator.training.rollout import verify_signature
        from coordinator.training.task import load_arrays

        if self.ca_cert_pem is not None:
            verify_signature(version.path, self.ca_cert_pem)
        x, _ = load_arrays(self.test_file)
        samples = {version.manifest.model.inputs[0].name: x[:SAMPLE_ROWS]}
        objective = self.store.active(model_id).objective
        record = self.deployer.deploy_version(model_id, version.path, samples, objective)
        return record.plan_version


def reference_target(state_dir: Path, deployer: Deployer, store: DeploymentStore) -> TrainingTarget:
    """The reference task, on the served deployment's active version when it is served."""
    version_dir, test_file, clients = prepared_task(reference_task_dir(state_dir))
    model_id: str | None = REFERENCE_MODEL_ID
    try:
        active = store.active(REFERENCE_MODEL_ID)
        version_dir = deployer.segment_dir(REFERENCE_MODEL_ID, active.plan_version)
        versions_root = state_dir / "training" / "versions" / REFERENCE_MODEL_ID
    except (UnknownModelError, NotServableError):
        model_id = None
        versions_root = version_dir.parent
    return TrainingTarget(
        version_dir=version_dir,
        test_file=test_file,
        versions_root=versions_root,
        population=len(LOCAL_BUDGETS),
        data_dirs=tuple(clients),
        budgets=LOCAL_BUDGETS,
        model_id=model_id,
    )


@dataclass(frozen=True)
class PairedAgents:
    """API runs train on the paired agents' SuperNodes (``coordinator --superlink-port``)."""

    config: AgentTrainingConfig
    host: str
    """The coordinator's interface: the SuperLink listens there."""
    node_keys: Callable[[], Mapping[str, str]]
    """The paired agents' node-authentication keys by name (:meth:`Pairing.node_keys`)."""


def agents_target(target: TrainingTarget, clients: int) -> TrainingTarget:
    """``target`` trained by ``clients`` agents' SuperNodes instead of local ones."""
    return replace(target, population=clients, data_dirs=(), budgets=())


def coordinator_runs(
    state_dir: Path,
    ca: CertificateAuthority,
    deployer: Deployer,
    store: DeploymentStore,
    agents: PairedAgents | None = None,
) -> TrainingRuns:
    """The training-run manager the coordinator's API serves."""
    from coordinator.training.task import TEST_FILE

    test_file = reference_task_dir(state_dir) / TEST_FILE

    def target() -> TrainingTarget:
        local = reference_target(state_dir, deployer, store)
        return local if agents is None else agents_target(local, agents.config.clients)

    settings = federation = None
    if agents is not None:
        port = agents.config.superlink_port
        settings = RunnerSettings(superlink_port=port)
        federation = agent_federation(ca, port, agents.node_keys, agents.host)
    publish = LivePublisher(deployer, store, test_file, ca.cert_pem)
    runner = FlowerRunner(state_dir / "training", ca, target, settings, publish, federation)
    return TrainingRuns(runner)
