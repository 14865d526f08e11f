"""Federated fine-tuning with real processes: a SuperLink (TLS, fedshard's CA, node
authentication) and three SuperNodes on 127.0.0.1, SecAgg+ and DP through ``flwr run``, started
and followed through the coordinator's ``/v1/training/runs`` API, with a new version every two
rounds and at the end.

Every process is stopped in ``finally`` blocks; every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

pytest.importorskip("torch")
pytest.importorskip("flwr")

from coordinator.ca import CertificateAuthority
from coordinator.training.flower import SuperLink, register_supernode, superlink
from coordinator.training.records import TrainingSettings
from coordinator.training.task import PreparedTask, load_arrays, prepare_task
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


def _api(task: PreparedTask, federation: Federation) -> tuple[TestClient, Path]:
    """The coordinator's API with a run manager whose runs use the fixture's federation."""
    from coordinator.api import Services, create_app
    from coordinator.pairing import Pairing
    from coordinator.registry import DeviceRegistry
    from coordinator.training.runner import FlowerRunner, TrainingTarget
    from coordinator.training.runs import TrainingRuns

    versions = federation.work / "versions"
    target = TrainingTarget(task.version_dir, task.test_file, versions, population=3)
    runner = FlowerRunner(
        federation.work / "training",
        federation.ca,
        lambda: target,
        federation=lambda run_dir, _target: nullcontext(federation.link),
    )
    pairing = Pairing(federation.work / "state", federation.ca)
    app = create_app(Services("tok", DeviceRegistry(), pairing, training=TrainingRuns(runner)))
    return TestClient(app, headers={"Authorization": "Bearer tok"}), versions


def test_five_secagg_dp_rounds_through_the_api_improve_accuracy_and_roll_out(
    task: PreparedTask, federation: Federation
) -> None:
    from flwr.serverapp import GaussianPrivacyEvent

    from coordinator.training.accounting import new_accountant
    from coordinator.training.records import TrainingRecord
    from coordinator.training.segments import run_chain
    from coordinator.training.server_app import load_weights
    from coordinator.training.version import Version

    noise = 0.05  # the runner's default, with clipping norm 1.0
    client, versions = _api(task, federation)
    with client as api:
        body = {"rounds": 5, "secure_aggregation": True, "dp": True, "rollout_every": 2}
        run_id = api.post("/v1/training/runs", json=body).json()["run_id"]
        assert api.post("/v1/training/runs", json=body).status_code == 409
        seen_mid_run: list[int] = []
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            run = api.get(f"/v1/training/runs/{run_id}").json()
            if run["status"] in ("finished", "failed"):
                break
            if 0 < len(run["rounds"]) < 5:
                seen_mid_run.append(len(run["rounds"]))
            time.sleep(0.5)
    assert run["status"] == "finished", run["error"]
    assert seen_mid_run, "rounds were not visible before the run finished"
    rounds = run["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    assert all(r["clients"] == 3 and r["bytes_uploaded"] > 0 for r in rounds)
    final = rounds[-1]["accuracy"]
    assert final > run["baseline_accuracy"] + 0.1, (run["baseline_accuracy"], final)
    # epsilon after every round equals a direct call of Flower's accountant
    for r in rounds:
        direct = new_accountant(3, 1e-5)
        direct.compose(GaussianPrivacyEvent(noise, 3, 3), count=r["round"])
        assert r["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    # a new version after rounds 2 and 4, and at the end
    assert [(v["round"], v["version"]) for v in run["rollouts"]] == [
        (2, "v0001"),
        (4, "v0002"),
        (5, "v0003"),
    ]
    run_dir = federation.work / "training" / "runs" / run_id
    record = TrainingRecord.from_json((run_dir / "record.json").read_bytes())
    # shard-wise: the small device trained the head only, the others both shards
    assert sorted(sorted(map(tuple, r.trained_shards.values())) for r in record.rounds[:1]) == [
        [(2, 3), (2, 3), (3,)]
    ]
    parent = Version.load(task.version_dir)
    child = Version.load(versions / "v0003")
    for p, c in zip(parent.manifest.segments, child.manifest.segments, strict=True):
        same = (parent.path / p.file).read_bytes() == (child.path / c.file).read_bytes()
        assert same == (p.index not in (2, 3))
    # the new version's ONNX predictions equal the new weights' predictions computed directly
    x, y = load_arrays(task.test_file)
    w1, b1, w2, b2 = load_weights(run_dir / "weights.npz")
    features = run_chain(parent.segments[:2], {"image": x})[parent.manifest.segments[2].inputs[0]]
    direct_logits = np.maximum(features @ w1.T + b1, 0) @ w2.T + b2
    onnx_logits = run_chain(child.segments, {"image": x})["logits"]
    np.testing.assert_allclose(onnx_logits, direct_logits, rtol=1e-4, atol=1e-4)
    assert (onnx_logits.argmax(1) == y).mean() == pytest.approx(final)
    # the version written after round 2 predicts with round 2's accuracy
    after_2 = run_chain(Version.load(versions / "v0001").segments, {"image": x})["logits"]
    assert (after_2.argmax(1) == y).mean() == pytest.approx(rounds[1]["accuracy"])


def test_a_client_killed_mid_round_does_not_break_the_round(
    task: PreparedTask, federation: Federation
) -> None:
    """Three shares, threshold two: the round completes with the two clients left."""
    import threading

    from coordinator.training.run import run_training

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
