"""Training runs, fast parts: the run manager and its API (fake runner), versions written every
k rounds, and live rollout of a trained version through the deployer (fake agents that run the
segments they are sent)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient

from coordinator.deploy.store import VersionRecord
from coordinator.errors import NotServableError
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from coordinator.training.errors import RunConflictError, TrainingRunError, UnknownRunError
from coordinator.training.manager import RunReporter, TrainingRuns
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.training import RunRollout, RunRound, TrainingRunRequest

TOKEN = "t0ken"


def _round(n: int) -> RunRound:
    return RunRound(
        round=n, loss=1.0 / n, accuracy=0.5, epsilon=None, clients=3, bytes_uploaded=10, seconds=1
    )


class GatedRunner:
    """Reports one round per ``step`` released by the test; fails or stops when told to."""

    def __init__(self, rounds: int = 2, fail: BaseException | None = None) -> None:
        self.rounds = rounds
        self.fail = fail
        self.step = threading.Semaphore(0)
        self.started = threading.Event()

    def run(
        self, run_id: str, request: TrainingRunRequest, report: RunReporter, stop: threading.Event
    ) -> None:
        self.started.set()
        report.running(0.4)
        for n in range(1, request.rounds + 1):
            while not self.step.acquire(timeout=0.05):
                if stop.is_set():
                    raise TrainingRunError(f"run {run_id} was stopped")
            if self.fail is not None:
                raise self.fail
            report.round(_round(n))
        report.rollout(RunRollout(round=request.rounds, directory="v0002"))


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_rounds_stream_while_the_run_goes_and_one_run_at_a_time() -> None:
    async def scenario() -> None:
        runner = GatedRunner()
        runs = TrainingRuns(runner)
        run_id = await runs.start(TrainingRunRequest(rounds=2, secure_aggregation=True, dp=True))
        await _until(runner.started.is_set)
        with pytest.raises(RunConflictError):
            await runs.start(TrainingRunRequest(rounds=1))
        runner.step.release()
        await _until(lambda: len(runs.get(run_id).rounds) == 1)
        mid = runs.get(run_id)
        assert (mid.status, mid.baseline_accuracy, mid.rollouts) == ("running", 0.4, [])
        runner.step.release()
        await runs.wait()
        done = runs.get(run_id)
        assert done.status == "finished" and done.error is None
        assert [r.round for r in done.rounds] == [1, 2]
        assert [r.directory for r in done.rollouts] == ["v0002"]
        # the next run may start now that the first has ended
        runner.step.release()
        second = await runs.start(TrainingRunRequest(rounds=1))
        await runs.wait()
        assert [s.run_id for s in runs.list()] == [run_id, second]
        with pytest.raises(UnknownRunError):
            runs.get("nope")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (TrainingRunError("only 1 of 3 clients answered"), "only 1 of 3 clients answered"),
        (ValueError("bad\n  shape"), "unexpected error (ValueError): bad shape"),
    ],
)
def test_a_failed_run_keeps_a_plain_error(error: BaseException, text: str) -> None:
    async def scenario() -> None:
        runner = GatedRunner(fail=error)
        runs = TrainingRuns(runner)
        run_id = await runs.start(TrainingRunRequest(rounds=3))
        runner.step.release()
        await runs.wait()
        failed = runs.get(run_id)
        assert (failed.status, failed.error, failed.rounds) == ("failed", text, [])

    asyncio.run(scenario())


def test_close_stops_the_run_and_waits_for_it() -> None:
    async def scenario() -> None:
        runner = GatedRunner()
        runs = TrainingRuns(runner)
        run_id = await runs.start(TrainingRunRequest(rounds=5))
        await _until(runner.started.is_set)
        await runs.close()
        stopped = runs.get(run_id)
        assert stopped.status == "failed" and "stopped" in (stopped.error or "")

    asyncio.run(scenario())


def _client(tmp_path: Path, runs: TrainingRuns) -> TestClient:
    from coordinator.http.app import Services, create_app

    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    app = create_app(Services(TOKEN, DeviceRegistry(), pairing, training=runs))
    return TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"})


def test_training_api(tmp_path: Path) -> None:
    runner = GatedRunner()
    runs = TrainingRuns(runner)
    with _client(tmp_path, runs) as api:
        assert (
            api.get("/v1/training/runs", headers={"Authorization": "Bearer x"}).status_code == 401
        )
        assert api.get("/v1/training/runs").json() == {"runs": []}
        for bad in ({"rounds": 0}, {"rounds": 2, "extra": 1}, {"secure_aggregation": True}):
            assert api.post("/v1/training/runs", json=bad).status_code == 400
        body = {"rounds": 2, "secure_aggregation": False, "dp": False}
        reply = api.post("/v1/training/runs", json=body)
        assert reply.status_code == 200
        run_id = reply.json()["run_id"]
        assert api.post("/v1/training/runs", json=body).status_code == 409
        runner.step.release()
        _wait(lambda: len(api.get(f"/v1/training/runs/{run_id}").json()["rounds"]) == 1)
        mid = api.get(f"/v1/training/runs/{run_id}").json()
        assert mid["status"] == "running" and mid["error"] is None
        assert mid["rounds"] == [
            {
                "round": 1,
                "loss": 1.0,
                "accuracy": 0.5,
                "epsilon": None,
                "clients": 3,
                "bytes_uploaded": 10,
                "seconds": 1.0,
            }
        ]
        runner.step.release()
        _wait(lambda: api.get(f"/v1/training/runs/{run_id}").json()["status"] == "finished")
        listed = api.get("/v1/training/runs").json()["runs"]
        assert [r["run_id"] for r in listed] == [run_id] and len(listed[0]["rounds"]) == 2
        assert api.get("/v1/training/runs/unknown").status_code == 404
        # a run still going when the app shuts down is stopped and awaited
        second = api.post("/v1/training/runs", json=body).json()["run_id"]
        _wait(lambda: api.get(f"/v1/training/runs/{second}").json()["status"] == "running")
    assert runs.get(second).status == "failed"


# ------------------------------------------------------------- versions every k rounds


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx.ModelProto, Path]:
    pytest.importorskip("torch")
    from devtools.digits import build_cnn, export_onnx, write_initial_version

    model = export_onnx(build_cnn(0))
    root = tmp_path_factory.mktemp("cnn")
    write_initial_version(model, root / "versions" / "v0001", ["d0", "d1"])
    return model, root / "versions" / "v0001"


class Reports:
    def __init__(self) -> None:
        self.baseline: list[float | None] = []
        self.rounds: list[RunRound] = []
        self.rollouts: list[RunRollout] = []

    def running(self, baseline_accuracy: float | None = None) -> None:
        self.baseline.append(baseline_accuracy)

    def round(self, metrics: RunRound) -> None:
        self.rounds.append(metrics)

    def rollout(self, rollout: RunRollout) -> None:
        self.rollouts.append(rollout)


def _record(rounds: int) -> Any:
    from coordinator.training.records import RoundMetrics, TrainingRecord, TrainingSettings

    settings = TrainingSettings(
        rounds=4,
        secagg=True,
        clipping_norm=None,
        noise_multiplier=None,
        delta=1e-5,
        trainable_shards=[3],
        local_epochs=1,
        learning_rate=0.01,
        batch_size=8,
        min_clients=3,
    )
    metrics = [
        RoundMetrics(round=r, test_loss=1.0, accuracy=0.5, clients=3, upload_bytes_per_client=100.5)
        for r in range(1, rounds + 1)
    ]
    return TrainingRecord(
        settings=settings, baseline_accuracy=0.25, baseline_loss=2.0, rounds=metrics
    )


def test_checkpoints_become_chained_versions_rolled_out(
    cnn: tuple[onnx.ModelProto, Path], tmp_path: Path
) -> None:
    from coordinator.training.records import Lineage
    from coordinator.training.runner import Follower, TrainingTarget
    from coordinator.training.server_app import save_weights
    from coordinator.training.version import Version

    _, v1 = cnn
    parent = Version.load(v1)
    record_file = tmp_path / "record.json"
    _record(0).save(record_file)
    target = TrainingTarget(v1, tmp_path / "test.npz", tmp_path / "out", 3, model_id="m")
    published: list[str] = []

    def publish(model_id: str, version: Version) -> VersionRecord:
        published.append(f"{model_id}:{version.name}")
        n = 1 + len(published)  # the model's numbers go on from its live v1; plan versions apart
        return VersionRecord.model_construct(model_id=model_id, version=n, plan_version=10 + n)

    reports = Reports()
    follower = Follower(parent, target, reports, publish, None, record_file)
    weights = parent.weights(parent.shard_specs([3]))
    for rounds in (2, 4):
        follower.round(_record(rounds).rounds[-1])
        changed = [w + rounds for w in weights]
        save_weights(tmp_path / f"w{rounds}.npz", changed)
        follower.checkpoint(_record(rounds), tmp_path / f"w{rounds}.npz")
    assert reports.baseline == [0.25]  # read once from the run's record
    assert reports.rounds[0].bytes_uploaded == 302 and reports.rounds[0].loss == 1.0
    assert published == ["m:v0001", "m:v0002"]
    assert [(r.round, r.directory, r.version, r.plan_version) for r in reports.rollouts] == [
        (2, "v0001", 2, 12),
        (4, "v0002", 3, 13),
    ]
    second = Version.load(tmp_path / "out" / "v0002")
    lineage = Lineage.from_json((second.path / "lineage.json").read_bytes())
    assert (lineage.parent_version, lineage.rounds, lineage.trained_segments) == ("v0001", 4, [3])
    np.testing.assert_array_equal(second.weights(second.shard_specs([3]))[0], weights[0] + 4)


def test_a_failed_live_rollout_fails_with_the_version_named(
    cnn: tuple[onnx.ModelProto, Path], tmp_path: Path
) -> None:
    from coordinator.training.errors import RolloutError
    from coordinator.training.runner import Follower, TrainingTarget
    from coordinator.training.server_app import save_weights
    from coordinator.training.version import Version

    parent = Version.load(cnn[1])
    target = TrainingTarget(cnn[1], tmp_path / "t.npz", tmp_path / "out", 3, model_id="m")

    def publish(model_id: str, version: Version) -> int:
        raise NotServableError("the chain is down")

    follower = Follower(parent, target, Reports(), publish, None, tmp_path / "record.json")
    save_weights(tmp_path / "w.npz", parent.weights(parent.shard_specs([3])))
    with pytest.raises(RolloutError, match="rolling v0001 out to m failed: the chain is down"):
        follower.checkpoint(_record(1), tmp_path / "w.npz")


# ------------------------------------------------------------- live rollout via the deployer


class SegmentAgents:
    """Fake agents that keep the segment bytes they are sent, so a health check can run them."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], tuple[int, bytes]] = {}
        self.unloaded: list[tuple[str, int]] = []

    def status(self, agent: Any) -> Any:
        from protocols.deploy import AgentStatus

        return AgentStatus(
            name=agent.device,
            device_id="ab" * 8,
            memory_budget_bytes=1 << 30,
            memory_committed_bytes=0,
            resident_memory_bytes=1,
            gflops=10.0,
            paired=True,
        )

    def deploy(self, agent: Any, body: bytes) -> Any:
        from protocols.deploy import DeployReport, decode_deploy_body

        request, segment, _ = decode_deploy_body(body)
        m = request.manifest
        self.held[(agent.device, m.plan_version)] = (m.segment.index, bytes(segment))
        return DeployReport(
            device=agent.device,
            plan_version=m.plan_version,
            segment_sha256=m.segment.sha256,
            predicted_memory_bytes=1,
            measured_memory_bytes=1,
            predicted_compute_s=0.0,
            load_s=0.0,
            warmup_first_s=0.0,
            warmup_s=0.0,
        )

    def unload(self, agent: Any, plan_version: int) -> Any:
        self.unloaded.append((agent.device, plan_version))
        return self.status(agent)

    def run(self, plan_version: int, feeds: dict[str, Any]) -> dict[str, Any]:
        from coordinator.training.segments import run_chain

        held = sorted(v for (_, pv), v in self.held.items() if pv == plan_version)
        return run_chain([data for _, data in held], feeds)


def _device(name: str, port: int) -> DeviceRecord:
    from protocols.profile import AgentState, Announcement, DeviceProfile

    profile = DeviceProfile(
        device_id="cd" * 8,
        name=name,
        memory_bytes=1 << 30,
        gflops=10.0,
        control_port=port,
        data_port=port + 1,
        cert_fingerprint="ef" * 32,
    )
    return DeviceRecord(
        Announcement(profile=profile, state=AgentState(paired=True)), "127.0.0.1", name, 0.0, 0.0
    )


def test_a_trained_version_is_rolled_out_live_to_the_served_deployment(
    cnn: tuple[onnx.ModelProto, Path], tmp_path: Path
) -> None:
    from coordinator.deploy.cutting import DeployCommand
    from coordinator.deploy.deployer import Deployer
    from coordinator.deploy.store import DeploymentStore
    from coordinator.training.driver import write_trained_version
    from coordinator.training.heldout import save_arrays
    from coordinator.training.server_app import save_weights
    from coordinator.training.target import LivePublisher
    from coordinator.training.version import Version
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    model, _ = cnn
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    alone = DeviceList.from_obj(
        {"devices": [{"name": "d0", "memory_bytes": 1 << 30, "gflops": 10, "bandwidth_mbps": 1}]}
    )
    whole = split_model(path, alone, tmp_path / "alone").manifest.segments[0]
    caps = {f"d{i}": whole.predicted_memory_bytes - 1 for i in range(2)}
    agents = SegmentAgents()
    ca = CertificateAuthority.open(tmp_path / "state")
    store = DeploymentStore(tmp_path / "state")
    answers: dict[int, dict[str, Any]] = {}

    def health(chain: Any, plan_version: int, feeds: dict[str, Any]) -> dict[str, Any]:
        answers[plan_version] = agents.run(plan_version, feeds)
        return answers[plan_version]

    devices = [_device("d0", 9000), _device("d1", 9010)]
    deployer = Deployer(
        tmp_path / "state",
        store,
        agents,
        lambda: devices,
        list,
        ca.sign,
        health,  # type: ignore[arg-type]
    )
    first = deployer.deploy(DeployCommand(path, "digits-cnn", memory_caps=caps))
    assert len(first.segments) == 2
    served = Version.load(deployer.segment_dir("digits-cnn", first.plan_version))
    last = len(served.segments) - 1
    record = _record(3).model_copy(
        update={"settings": _record(3).settings.model_copy(update={"trainable_shards": [last]})}
    )
    new_weights = [w * 0.5 for w in served.weights(served.shard_specs([last]))]
    save_weights(tmp_path / "w.npz", new_weights)
    trained = write_trained_version(served, record, tmp_path / "w.npz", tmp_path / "v0001", ca)
    x = np.random.default_rng(0).random((20, 1, 8, 8), dtype=np.float32)
    save_arrays(tmp_path / "test.npz", x, np.zeros(20, np.int64))

    live = LivePublisher(deployer, store, tmp_path / "test.npz")("digits-cnn", trained)
    plan_version = live.plan_version

    assert live == store.active("digits-cnn") and live.version == first.version + 1 == 2
    assert plan_version == first.plan_version + 1
    assert store.model("digits-cnn").previous == first.version  # still loaded: rollback
    assert agents.unloaded == []
    # what the agents now serve equals the new weights' predictions computed directly
    from coordinator.training.segments import run_chain

    direct = run_chain(list(trained.segments), {"image": x[:8]})["logits"]
    old = run_chain(list(served.segments), {"image": x[:8]})["logits"]
    np.testing.assert_allclose(answers[plan_version]["logits"], direct, rtol=1e-5, atol=1e-6)
    assert not np.allclose(direct, old)
    kept = deployer.segment_dir("digits-cnn", plan_version)
    assert (kept / "lineage.json").is_file() and (kept / "manifest.json.sig").is_file()
