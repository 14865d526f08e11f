"""Federated fine-tuning on real agents: three ``fedshard agent --train-data`` processes, each
with its own SuperNode (node-authentication key made by the agent), a SuperLink with node
authentication (only the registered agents' keys get in), SecAgg+ and DP through ``flwr run``,
started through the coordinator's ``/v1/training/runs`` API as ``fedshard coordinator
--superlink-port`` wires it (:func:`coordinator_runs` with :class:`PairedAgents`), and the trained
version rolled out live to the deployment those same agents serve.

The coordinator's parts (CA, deployer, router, run manager, API) run in this process; agents,
SuperLink, SuperNodes and Flower's apps are real processes on 127.0.0.1. Five rounds with a
version every two: accuracy rises by a margin, epsilon equals Flower's accountant called
directly, only the trained segments change, and the agents serve each version in turn.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from agent_helpers import AgentProc, start_agent, stop_agent
from coordinator_helpers import paired_record
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fastapi.testclient import TestClient

pytest.importorskip("torch")
pytest.importorskip("flwr")

from coordinator.training.flower import free_port
from coordinator.training.heldout import load_arrays
from coordinator.trust.ca import CertificateAuthority
from devtools.digits import (
    MODEL_FILE,
    PreparedTask,
    prepared_task,
    reference_task_dir,
    write_reference_target,
)
from protocols.deploy import ROLE_AGENT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "digits-cnn"
NAMES = ["agent-0", "agent-1", "agent-2"]
ROUNDS = 5
MARGIN = 0.1
"""Held-out accuracy after the run must beat the pre-trained model's by at least this much."""
BUDGETS = ["50000", "1GiB", "1GiB"]
"""agent-0 fits only the head shard's training; the others fit both trainable shards."""


@dataclass
class Cluster:
    agents: list[AgentProc]
    ca: CertificateAuthority
    state: Path
    superlink_port: int
    version_dir: Path
    task: PreparedTask


def _three_segment_version(task: PreparedTask, out: Path) -> Path:
    """The task's CNN cut in three (convolutions | fc1 | fc2): one segment per agent."""
    from devtools.digits import layer_boundaries, write_initial_version

    model = onnx.load(task.model_file)
    write_initial_version(model, out, NAMES, boundaries=layer_boundaries(model)[1:])
    return out


def _tls_files(ca: CertificateAuthority, name: str, out: Path) -> list[str]:
    """``--ca --cert --key`` for ``name``, as pairing would have left them."""
    key = ec.generate_private_key(ec.SECP256R1())
    issued = ca.issue_for_key(key.public_key(), name, ROLE_AGENT)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.pem").write_bytes(ca.cert_pem)
    (out / "cert.pem").write_bytes(issued.pem)
    (out / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files = [out / "ca.pem", out / "cert.pem", out / "key.pem"]
    return [
        arg
        for flag, f in zip(("--ca", "--cert", "--key"), files, strict=True)
        for arg in (flag, str(f))
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("agents-train")
    state = tmp / "coordinator"
    root = reference_task_dir(state)  # where the coordinator's runs find the held-out set
    task = PreparedTask(*prepared_task(root), model_file=root / MODEL_FILE)
    version_dir = _three_segment_version(task, tmp / "v3")
    ca = CertificateAuthority.open(state)
    port = free_port()
    started: list[AgentProc] = []
    try:
        for i, name in enumerate(NAMES):
            if started:  # reuse the first agent's measured profile
                (tmp / f"state-{name}").mkdir(parents=True, exist_ok=True)
                shutil.copy(started[0].state_dir / "profile.json", tmp / f"state-{name}")
            extra = _tls_files(ca, name, tmp / f"tls-{name}")
            extra += ["--train-data", str(task.client_dirs[i])]
            extra += ["--train-superlink", f"127.0.0.1:{port}"]
            extra += ["--train-segments", str(version_dir), "--train-budget", BUDGETS[i]]
            extra += ["--allow-non-dp"]  # shard training's DP is the server's, not the device's
            started.append(start_agent(tmp, name, None, memory="256MiB", extra=extra))
        yield Cluster(started, ca, state, port, version_dir, task)
    finally:
        for agent in started:
            stop_agent(agent)


def _node_keys(cluster: Cluster) -> dict[str, str]:
    """What the pairing book holds: each agent's node public key, made by the agent itself."""
    from edge_agent.trust.pairing import node_key_dir

    keys = {}
    for agent in cluster.agents:
        public = node_key_dir(agent.state_dir) / "node_auth_key.pub"
        deadline = time.monotonic() + 30
        while not public.is_file():
            assert time.monotonic() < deadline, f"{agent.name} made no node key"
            time.sleep(0.1)
        keys[agent.name] = public.read_text().strip()
    return keys


def run_id_of(run: dict[str, Any]) -> str:
    return str(run["run_id"])


def _follow_run(api: TestClient, rounds: int) -> tuple[dict[str, Any], list[int]]:
    """Start a SecAgg+ and DP run with a rollout every 2 rounds; poll it to its end.

    Returns its final status and the round counts seen while it was still going.
    """
    body = {"rounds": rounds, "secure_aggregation": True, "dp": True, "rollout_every": 2}
    run_id = api.post("/v1/training/runs", json=body).json()["run_id"]
    assert api.post("/v1/training/runs", json=body).status_code == 409  # one run at a time
    seen_mid_run: list[int] = []
    deadline = time.monotonic() + 720
    while time.monotonic() < deadline:
        run: dict[str, Any] = api.get(f"/v1/training/runs/{run_id}").json()
        if run["status"] in ("finished", "failed"):
            return run, seen_mid_run
        if 0 < len(run["rounds"]) < rounds:
            seen_mid_run.append(len(run["rounds"]))
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not finish in time")


def _check_rounds(run: dict[str, Any]) -> None:
    """Five rounds of all three agents, accuracy up by a margin, epsilon as Flower's accountant."""
    from flwr.serverapp import GaussianPrivacyEvent

    from coordinator.training.accounting import new_accountant
    from coordinator.training.runner import RunnerSettings

    rounds = run["rounds"]
    assert [(r["round"], r["clients"]) for r in rounds] == [(i, 3) for i in range(1, ROUNDS + 1)]
    assert all(r["bytes_uploaded"] > 0 for r in rounds)
    final = rounds[-1]["accuracy"]
    assert final > run["baseline_accuracy"] + MARGIN, (run["baseline_accuracy"], final)
    fixed = RunnerSettings()  # the coordinator's runs: clipping 1.0, noise multiplier 0.05
    for r in rounds:
        direct = new_accountant(3, fixed.delta)
        direct.compose(GaussianPrivacyEvent(fixed.noise_multiplier, 3, 3), count=r["round"])
        assert r["epsilon"] == pytest.approx(direct.get_epsilon(fixed.delta), rel=1e-9)


def test_real_agents_train_and_serve_the_new_version(cluster: Cluster) -> None:
    from coordinator.config import AgentTrainingConfig
    from coordinator.deploy.deployer import Deployer
    from coordinator.deploy.store import DeploymentStore
    from coordinator.fleet.registry import DeviceRegistry
    from coordinator.http.app import Services, create_app
    from coordinator.serving.router import Router
    from coordinator.training.records import TrainingRecord
    from coordinator.training.segments import run_chain
    from coordinator.training.server_app import load_weights
    from coordinator.training.target import PairedAgents, coordinator_runs
    from coordinator.training.version import Version
    from coordinator.transport.agent_client import AgentClient
    from coordinator.transport.dataplane import DataPlane
    from coordinator.transport.tls import client_context
    from coordinator.trust.identity import open_identity
    from coordinator.trust.pairing import Pairing
    from protocols.plan import Objective

    state, ca = cluster.state, cluster.ca
    ctx = client_context(open_identity(state, ca))
    store = DeploymentStore(state)
    plane = DataPlane()
    router = Router(store, plane, ctx)
    devices = [paired_record(a) for a in cluster.agents]
    deployer = Deployer(
        state, store, AgentClient(ctx), lambda: devices, list, ca.sign, router.health
    )
    x, y = load_arrays(cluster.task.test_file)
    try:
        first = deployer.deploy_version(
            MODEL_ID, cluster.version_dir, {"image": x[:8]}, Objective.THROUGHPUT
        )
        served = Version.load(deployer.segment_dir(MODEL_ID, first.plan_version))
        _, before = router.infer(MODEL_ID, {"image": x})
        keys = _node_keys(cluster)
        agents = PairedAgents(
            AgentTrainingConfig(cluster.superlink_port, clients=3), "127.0.0.1", lambda: keys
        )
        target = write_reference_target(state)
        runs = coordinator_runs(state, ca, deployer, store, target, agents)
        app = create_app(Services("tok", DeviceRegistry(), Pairing(state, ca), training=runs))
        with TestClient(app, headers={"Authorization": "Bearer tok"}) as api:
            run, seen_mid_run = _follow_run(api, ROUNDS)
        assert run["status"] == "finished", run["error"]
        assert seen_mid_run, "rounds were not visible before the run finished"
        _check_rounds(run)
        run_dir = state / "training" / "runs" / run_id_of(run)
        record = TrainingRecord.from_json((run_dir / "record.json").read_bytes())
        # each real agent trained what its --train-budget fits: agent-0 the head only
        assert sorted(tuple(s) for s in record.rounds[0].trained_shards.values()) == [
            (1, 2),
            (1, 2),
            (2,),
        ]
        # a version after rounds 2 and 4 and at the end, each rolled out to the served model
        rollouts = [
            (r["round"], r["directory"], r["version"], r["plan_version"]) for r in run["rollouts"]
        ]
        base = first.plan_version
        assert first.version == 1  # each rollout is the model's next version, numbered on its own
        assert rollouts == [
            (2, "v0001", 2, base + 1),
            (4, "v0002", 3, base + 2),
            (5, "v0003", 4, base + 3),
        ]
        active = store.active(MODEL_ID)
        assert (active.version, active.plan_version) == (4, base + 3)
        trained = Version.load(deployer.segment_dir(MODEL_ID, active.plan_version))
        for old, new in zip(served.manifest.segments, trained.manifest.segments, strict=True):
            same = (served.path / old.file).read_bytes() == (trained.path / new.file).read_bytes()
            assert same == (old.index == 0), old.index  # only the trained shards changed
        # what the real agents now serve equals the new weights' predictions, computed directly
        answered, after = router.infer(MODEL_ID, {"image": x})
        assert answered.plan_version == active.plan_version
        w1, b1, w2, b2 = load_weights(run_dir / "weights.npz")
        features = run_chain(served.segments[:1], {"image": x})[
            served.manifest.segments[1].inputs[0]
        ]
        direct = np.maximum(features @ w1.T + b1, 0) @ w2.T + b2
        np.testing.assert_allclose(after["logits"], direct, rtol=1e-4, atol=1e-4)
        assert not np.allclose(after["logits"], before["logits"], atol=1e-3)
        accuracy = float((after["logits"].argmax(1) == y).mean())
        assert accuracy == pytest.approx(run["rounds"][-1]["accuracy"])
    finally:
        router.close()
        plane.close()
