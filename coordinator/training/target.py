"""The coordinator's training target: configured (``--training-target FILE``), never imported.

``fedshard coordinator`` builds :func:`coordinator_runs` once. A run (``POST /v1/training/runs``)
fine-tunes what the target file (:class:`~protocols.training.TrainingTargetSpec`) names, with one
local SuperNode per listed data directory, or, when the coordinator was given
``--superlink-port`` (:class:`PairedAgents`), with the paired agents' own SuperNodes: a
SuperLink with node authentication admits exactly the keys they sent when they paired (a LoRA
run first sends them the served version: :mod:`coordinator.training.copies`). Without a target,
a run is refused with :class:`~coordinator.training.errors.NoTrainingTargetError` (409), except
a LoRA run of a served model on paired agents, which needs none.
``fedshard demo`` writes one for the reference digits task (:mod:`devtools.digits`).

When the target's ``model_id`` is served, the run trains the served version's own segments and
rolls each new version out to it live; otherwise it trains the target's version and only writes
new version directories.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from threading import Event

from pydantic import ValidationError

from coordinator.config import AgentTrainingConfig
from coordinator.deploy.deployer import Deployer
from coordinator.deploy.store import DeploymentStore, VersionRecord
from coordinator.errors import AgentError, NotServableError, UnknownModelError
from coordinator.training.errors import LoraTargetError, NoTrainingTargetError, TrainingError
from coordinator.training.heldout import load_arrays
from coordinator.training.lora.runner import LoraRunner, LoraTarget
from coordinator.training.lora.target import (
    DecoderPublisher,
    MethodRunner,
    local_lora_federation,
    paired_lora_federation,
    served_lora_target,
)
from coordinator.training.manager import RunReporter, TrainingRuns
from coordinator.training.runner import (
    FlowerRunner,
    RunnerSettings,
    TrainingTarget,
    agent_federation,
)
from coordinator.training.version import Version
from coordinator.transport.agent_client import AgentAddress, AgentClient
from coordinator.trust.ca import CertificateAuthority
from protocols.ledger import PrivacyStatus, RunFate, RunFateReport
from protocols.training import TrainingRunRequest, TrainingTargetSpec
from protocols.training_copy import TrainingCopyOffer

log = logging.getLogger(__name__)

SAMPLE_ROWS = 8
"""Held-out rows used as warm-up and health-check inputs of a live rollout."""
NO_TARGET = (
    "no training target is configured: start the coordinator with --training-target FILE "
    "(a fedshard.training-target/1 JSON file; `fedshard demo` writes one for the digits task)"
)


def load_target(path: Path) -> TrainingTargetSpec:
    """The target file at ``path``; raises TrainingError when it is unreadable or malformed."""
    try:
        return TrainingTargetSpec.model_validate_json(path.read_bytes())
    except OSError as exc:
        raise TrainingError(f"cannot read the training target {path}: {exc}") from exc
    except ValidationError as exc:
        raise TrainingError(f"{path} is not a training target: {exc.errors()[0]['msg']}") from exc


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

    def __call__(self, model_id: str, version: Version) -> VersionRecord:
        """Verify ``version``'s signature, deploy it beside the live one, health-check it,
        switch; the version now served."""
        from coordinator.training.rollout import verify_signature

        if self.ca_cert_pem is not None:
            verify_signature(version.path, self.ca_cert_pem)
        x, _ = load_arrays(self.test_file)
        samples = {version.manifest.model.inputs[0].name: x[:SAMPLE_ROWS]}
        objective = self.store.active(model_id).objective
        return self.deployer.deploy_version(model_id, version.path, samples, objective)


def configured_target(
    spec_file: Path, state_dir: Path, deployer: Deployer, store: DeploymentStore
) -> TrainingTarget:
    """The target file's task, on the served deployment's active version when it is served."""
    spec, root = load_target(spec_file), spec_file.parent
    if spec.version_dir is None or spec.test_file is None:
        raise NoTrainingTargetError(
            f"{spec_file} names no version_dir and test_file: only method lora runs here"
        )
    version_dir = root / spec.version_dir
    model_id: str | None = spec.model_id
    try:
        active = store.active(spec.model_id)
        version_dir = deployer.segment_dir(spec.model_id, active.plan_version)
        versions_root = state_dir / "training" / "versions" / spec.model_id
    except (UnknownModelError, NotServableError):
        model_id = None
        versions_root = version_dir.parent
    clients = tuple(root / c for c in spec.client_data)
    return TrainingTarget(
        version_dir=version_dir,
        test_file=root / spec.test_file,
        versions_root=versions_root,
        population=len(clients),
        data_dirs=clients,
        budgets=tuple(spec.budgets),
        model_id=model_id,
    )


@dataclass(frozen=True)
class PairedAgents:
    """API runs train on the paired agents' SuperNodes (``coordinator --superlink-port``)."""

    config: AgentTrainingConfig
    host: str
    """The coordinator's interface: the SuperLink listens there."""
    node_keys: Callable[[], Mapping[str, str]]
    """The paired agents' node-authentication keys by name
    (:meth:`~coordinator.trust.pairing.Pairing.node_keys`)."""
    client: AgentClient | None = None
    """Control-plane client: a LoRA run sends the served version to the agents first."""
    devices: Callable[[], list[AgentAddress]] = list
    """The paired agents online now."""

    def privacy(self) -> dict[str, PrivacyStatus]:
        """Each online training agent's privacy ledger totals (``GET /v1/training/privacy``);
        an agent that cannot answer (no ledger route, unreachable) is logged and left out."""
        if self.client is None:
            return {}
        keyed = self.node_keys()
        out: dict[str, PrivacyStatus] = {}
        for agent in self.devices():
            if agent.device not in keyed:
                continue
            try:
                out[agent.device] = self.client.training_privacy(agent)
            except AgentError as exc:
                log.warning("%s: no privacy ledger report: %s", agent.device, exc)
        return out

    def mark_run(self, run_id: str, fate: RunFate) -> None:
        """Tell each online training agent's ledger what became of ``run_id`` (an agent that
        cannot be told is logged: the fate is informational, its rounds count regardless)."""
        if self.client is None:
            return
        keyed = self.node_keys()
        report = RunFateReport(run=run_id, fate=fate)
        for agent in self.devices():
            if agent.device not in keyed:
                continue
            try:
                self.client.training_run_fate(agent, report)
            except AgentError as exc:
                log.warning("%s: cannot record run %s as %s: %s", agent.device, run_id, fate, exc)

    def send_copy(self, offer: TrainingCopyOffer, segments: Path, needed: int) -> list[str]:
        """Send a run's version to the online agents that have a node key; who holds it."""
        from coordinator.training.copies import send_to_trainers

        if self.client is None:
            raise LoraTargetError("this coordinator cannot reach its agents' control planes")
        keyed = self.node_keys()
        agents = [a for a in self.devices() if a.device in keyed]
        return send_to_trainers(self.client, agents, offer, segments, needed)


def agents_target(target: TrainingTarget, clients: int) -> TrainingTarget:
    """``target`` trained by ``clients`` agents' SuperNodes instead of local ones."""
    return replace(target, population=clients, data_dirs=(), budgets=())


def coordinator_runs(
    state_dir: Path,
    ca: CertificateAuthority,
    deployer: Deployer,
    store: DeploymentStore,
    target_file: Path | None,
    agents: PairedAgents | None = None,
    model_cache: Path | None = None,
) -> TrainingRuns:
    """The training-run manager the coordinator's API serves (refusing runs without a target)."""
    if target_file is None and agents is None:
        return TrainingRuns(_Refusing(), ready=_no_target)
    lora = lora_runner(state_dir, ca, deployer, store, target_file, agents, model_cache)
    if target_file is None:  # paired agents, no digits task: only LoRA runs of served models
        return TrainingRuns(MethodRunner(_Refusing(), lora), ready=_admission(lora, False))
    spec = load_target(target_file)

    def target() -> TrainingTarget:
        local = configured_target(target_file, state_dir, deployer, store)
        return local if agents is None else agents_target(local, agents.config.clients)

    settings = federation = None
    if agents is not None:
        port = agents.config.superlink_port
        settings = RunnerSettings(superlink_port=port)
        federation = agent_federation(ca, port, agents.node_keys, agents.host)
    test_file = target_file.parent / spec.test_file if spec.test_file else Path("-")
    publish = LivePublisher(deployer, store, test_file, ca.cert_pem)
    runner = FlowerRunner(state_dir / "training", ca, target, settings, publish, federation)
    return TrainingRuns(MethodRunner(runner, lora), ready=_admission(lora, True))


LOCAL_CACHE = "local-cache"
"""Under the coordinator's ``training`` dir: the local SuperNodes' caches, kept between runs."""


def lora_runner(
    state_dir: Path,
    ca: CertificateAuthority,
    deployer: Deployer,
    store: DeploymentStore,
    target_file: Path | None,
    agents: PairedAgents | None,
    model_cache: Path | None,
) -> LoraRunner:
    """The runner of ``method: lora`` requests (see :mod:`coordinator.training.lora.target`):
    on the target's local text SuperNodes, or on the paired agents when there are any."""
    from partitioner.models.decoders.cache import default_cache_dir

    data: tuple[Path, ...] = ()
    cache = state_dir / "training" / LOCAL_CACHE
    if target_file is not None:
        spec = load_target(target_file)
        data = tuple(target_file.parent / d for d in spec.text_client_data)
        if spec.text_client_cache is not None:
            cache = target_file.parent / spec.text_client_cache
    clients = None if agents is None else agents.config.clients

    def resolve(model_id: str) -> LoraTarget:
        return served_lora_target(
            model_id, state_dir, deployer, store, data, (), clients, cache_root=cache
        )

    federation = local_lora_federation(ca)
    if agents is not None:
        port = agents.config.superlink_port
        federation = paired_lora_federation(
            ca, port, agents.host, agents.node_keys, agents.send_copy
        )
    return LoraRunner(
        state_dir / "training",
        ca,
        resolve,
        federation,
        DecoderPublisher(deployer, store, ca.cert_pem),
        model_cache or default_cache_dir(os.environ.get("FEDSHARD_CACHE")),
        privacy=None if agents is None else agents.privacy,
        mark_run=None if agents is None else agents.mark_run,
    )


def _admission(lora: LoraRunner, shards: bool) -> Callable[[TrainingRunRequest], None]:
    """The check of a request before it starts: a LoRA run's model must resolve and its
    options fit the model; a shards run needs a training target (``shards``)."""

    def ready(request: TrainingRunRequest) -> None:
        if request.resolved_method == "lora":
            lora.admit(request)
        elif not shards:
            _no_target()

    return ready


def _no_target(request: TrainingRunRequest | None = None) -> None:
    raise NoTrainingTargetError(NO_TARGET)


class _Refusing:
    """The runner of a coordinator without a training target."""

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: Event
    ) -> None:
        """Refuse: there is nothing to train."""
        _no_target()
