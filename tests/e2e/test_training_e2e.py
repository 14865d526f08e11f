"""Federated fine-tuning's failure cases with real processes: a SuperLink (TLS, fedshard's CA,
node authentication) and three SuperNodes on 127.0.0.1, SecAgg+ and DP through ``flwr run``.
A client killed mid-round, and a SuperNode whose key was never registered.

The five-round run on real agents through the coordinator's API (accuracy margin, accounting,
rollouts) is ``test_training_agents_e2e.py``. Every process is stopped in ``finally`` blocks;
every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("flwr")

from coordinator.training.flower import SuperLink, register_supernode, superlink
from coordinator.training.records import TrainingSettings
from coordinator.trust.ca import CertificateAuthority
from devtools.digits import PreparedTask, prepare_task
from edge_agent.training.supernode import (
    SuperNodeConfig,
    SuperNodeProcess,
    make_node_key,
    start_supernode,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUDGETS = [50_000, 10**9, 10**9]
"""The first device fits only the head shard's training; the others fit both shards."""


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> PreparedTask:
    return prepare_task(tmp_path_factory.mktemp("task"), num_clients=3, alpha=0.5, seed=0)


@dataclass
class Federation:
    link: SuperLink
    nodes: list[SuperNodeProcess]
    work: Path
    ca: CertificateAuthority


@pytest.fixture
def federation(task: PreparedTask, tmp_path: Path) -> Iterator[Federation]:
    ca = CertificateAuthority.open(tmp_path / "ca")
    nodes: list[SuperNodeProcess] = []
    with superlink(tmp_path / "link", ca, node_auth=True) as link:
        try:
            for i, budget in enumerate(BUDGETS):
                private_key, public_key = make_node_key(tmp_path / f"node{i}" / "keys")
                register_supernode(link, public_key)
                config = SuperNodeConfig(
                    superlink=link.address,
                    root_certificates=link.tls.ca_cert,
                    segments_dir=task.version_dir,
                    data_dir=task.client_dirs[i],
                    work_dir=tmp_path / f"node{i}",
                    budget_bytes=budget,
                    auth_private_key=private_key,
                )
                nodes.append(start_supernode(config))
            yield Federation(link, nodes, tmp_path, ca)
        finally:
            for node in nodes:
                node.stop()


def _settings(rounds: int, noise: float | None) -> TrainingSettings:
    return TrainingSettings(
        rounds=rounds,
        secagg=True,
        clipping_norm=1.0 if noise else None,
        noise_multiplier=noise,
        delta=1e-5,
        trainable_shards=[2, 3],
        local_epochs=2,
        learning_rate=0.003,
        batch_size=32,
        min_clients=3,
    )


def test_a_client_killed_mid_round_does_not_break_the_round(
    task: PreparedTask, federation: Federation
) -> None:
    """Three shares, threshold two: the round completes with the two clients left."""
    import threading

    from coordinator.training.driver import run_training

    victim = federation.nodes[2]
    cache = victim.config.work_dir / "cache"
    stop = threading.Event()

    def kill_when_training_starts() -> None:
        deadline = time.monotonic() + 300
        while not stop.is_set() and time.monotonic() < deadline:
            if any(cache.glob("features-*.npz")):  # its ClientApp is in the masked-vector stage
                victim.kill()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_training_starts)
    killer.start()
    try:
        result = run_training(
            federation.link,
            federation.work / "run",
            task.version_dir,
            task.test_file,
            _settings(1, 0.05),
            population=3,
            stage_timeout_s=45,
            timeout_s=400,
        )
    finally:
        stop.set()
        killer.join(timeout=10)
    assert not victim.alive()
    assert result.record.finished
    assert result.record.rounds[0].clients == 2
    assert np.isfinite(result.record.rounds[0].accuracy)


def test_an_unregistered_supernode_is_refused(tmp_path: Path) -> None:
    """Node authentication: a SuperNode whose key was never registered cannot join."""
    ca = CertificateAuthority.open(tmp_path / "ca")
    with superlink(tmp_path / "link", ca, node_auth=True) as link:
        private_key, _ = make_node_key(tmp_path / "keys")
        node = start_supernode(
            SuperNodeConfig(
                superlink=link.address,
                root_certificates=link.tls.ca_cert,
                segments_dir=tmp_path,
                data_dir=tmp_path,
                work_dir=tmp_path / "node",
                auth_private_key=private_key,
            )
        )
        try:
            deadline = time.monotonic() + 90
            while node.alive() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not node.alive()
        finally:
            node.stop()
    assert "Failed to activate SuperNode" in node.log_path.read_text(errors="replace")
