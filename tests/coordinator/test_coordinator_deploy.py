"""Unit tests of deploy planning, signing and versioning, with fake agents (no sockets)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from graph_helpers import block_stack

from coordinator.deploy.cutting import DeployCommand
from coordinator.deploy.deployer import Deployer
from coordinator.deploy.plan import LiveDevice, device_list, forward_names, max_abs_diff
from coordinator.deploy.store import DeploymentStore, Placement, VersionRecord
from coordinator.errors import (
    AgentRefusedError,
    DeployError,
    NoFitError,
    NoRoomError,
    NotServableError,
    RollbackError,
    StateError,
    UnknownModelError,
)
from coordinator.fleet.registry import DeviceRecord
from coordinator.transport.agent_client import AgentAddress
from coordinator.trust.ca import CertificateAuthority
from protocols.deploy import (
    AgentStatus,
    DeployReport,
    Hop,
    decode_deploy_body,
    signing_bytes,
)
from protocols.errors import ControlErrorCode
from protocols.frames import decode_frame
from protocols.links import Link
from protocols.manifest import Manifest, ModelInfo, SegmentEntry, TensorInfo
from protocols.plan import Objective
from protocols.profile import AgentState, Announcement, DeviceProfile

SHA = "0" * 64


def _live(name: str, budget: int, committed: int = 0) -> LiveDevice:
    return LiveDevice(name, budget, committed, 10.0, "127.0.0.1", 9000, 9001)


def test_device_list_uses_free_memory_caps_and_known_links() -> None:
    devices = [_live("a", 100, 30), _live("b", 100), _live("c", 50)]
    links = [
        Link(a="a", b="b", bandwidth_mbps=80, latency_ms=2),
        Link(a="a", b="gone", bandwidth_mbps=5),
    ]
    listed = device_list(devices, links, {"b": 40})
    assert [d.memory_bytes for d in listed.devices] == [70, 40, 50]
    assert [(link.a, link.b) for link in listed.links] == [("a", "b")]
    with pytest.raises(DeployError, match="not paired and online"):
        device_list(devices, [], {"stranger": 1})
    with pytest.raises(DeployError, match="no paired agent"):
        device_list([], [], {})


def _manifest() -> Manifest:
    def seg(index: int, inputs: list[str], outputs: list[str]) -> SegmentEntry:
        return SegmentEntry(
            index=index,
            device=f"d{index}",
            file=f"segment{index}.onnx",
            sha256=SHA,
            inputs=inputs,
            outputs=outputs,
            param_bytes=1,
            predicted_memory_bytes=1,
            predicted_compute_s=0.1,
        )

    info = [TensorInfo(name="x", dtype="float32", shape=["batch", 4])]
    return Manifest(
        model=ModelInfo(
            name="m",
            sha256=SHA,
            param_bytes=3,
            inputs=info,
            outputs=[TensorInfo(name="y", dtype="float32", shape=["batch", 4])],
        ),
        objective="throughput",
        bottleneck_s=0.1,
        latency_s=0.3,
        segments=[seg(0, ["x"], ["h"]), seg(1, ["h", "x"], ["g"]), seg(2, ["g"], ["y"])],
    )


def test_forward_names_carry_what_later_stages_need() -> None:
    manifest = _manifest()
    assert forward_names(manifest, 0) == ["h", "x"]  # x passes through to segment 1
    assert forward_names(manifest, 1) == ["g"]
    assert forward_names(manifest, 2) == ["y"]


def test_max_abs_diff() -> None:
    want = {"y": np.ones((2, 2), np.float32)}
    assert max_abs_diff({"y": np.ones((2, 2), np.float32) * 1.5}, want) == 0.5
    assert max_abs_diff({}, want) == float("inf")
    assert max_abs_diff({"y": np.ones(3, np.float32)}, want) == float("inf")


# ------------------------------------------------------------------------- deployer with fakes


class FakeAgents:
    """Checks what a real agent checks first (signature, hash, target), records the rest."""

    def __init__(
        self,
        ca_pem: bytes,
        budget: int,
        refuse: str | None = None,
        why: ControlErrorCode = ControlErrorCode.SEGMENT_LOAD,
    ) -> None:
        self.ca_key = x509.load_pem_x509_certificate(ca_pem).public_key()
        self.budget = budget
        self.refuse = refuse
        self.why = why
        self.deployed: dict[str, dict[int, Any]] = {}
        self.unloaded: list[tuple[str, int]] = []

    def status(self, agent: AgentAddress) -> AgentStatus:
        held = self.deployed.get(agent.device, {})
        committed = sum(m.segment.predicted_memory_bytes for m in held.values())
        return AgentStatus(
            name=agent.device,
            device_id="ab" * 8,
            memory_budget_bytes=self.budget,
            memory_committed_bytes=committed,
            resident_memory_bytes=1,
            gflops=10.0,
            paired=True,
        )

    def deploy(self, agent: AgentAddress, body: bytes) -> DeployReport:
        request, segment, warmup = decode_deploy_body(body)
        manifest = request.manifest
        assert isinstance(self.ca_key, ec.EllipticCurvePublicKey)
        self.ca_key.verify(
            bytes.fromhex(request.signature_hex),
            signing_bytes(manifest),
            ec.ECDSA(hashes.SHA256()),
        )
        onnx.load_from_string(bytes(segment))  # only its own segment, a whole ONNX model
        feeds = decode_frame(bytes(warmup)).tensors
        assert set(feeds) == set(manifest.segment.inputs)
        assert manifest.segment.device == agent.device
        if agent.device == self.refuse:
            raise AgentRefusedError(agent.device, 422, self.why, "refused")
        self.deployed.setdefault(agent.device, {})[manifest.plan_version] = manifest
        return DeployReport(
            device=agent.device,
            plan_version=manifest.plan_version,
            segment_sha256=manifest.segment.sha256,
            predicted_memory_bytes=manifest.segment.predicted_memory_bytes,
            measured_memory_bytes=123,
            predicted_compute_s=manifest.segment.predicted_compute_s,
            load_s=0.01,
            warmup_first_s=0.01,
            warmup_s=0.002,
        )

    def unload(self, agent: AgentAddress, plan_version: int) -> AgentStatus:
        self.unloaded.append((agent.device, plan_version))
        self.deployed.get(agent.device, {}).pop(plan_version, None)
        return self.status(agent)


def _record(name: str, port: int) -> DeviceRecord:
    profile = DeviceProfile(
        device_id="cd" * 8,
        name=name,
        memory_bytes=1 << 30,
        gflops=10.0,
        control_port=port,
        data_port=port + 1,
        cert_fingerprint="ef" * 32,
    )
    announcement = Announcement(profile=profile, state=AgentState(paired=True))
    return DeviceRecord(announcement, "127.0.0.1", f"{name}-svc", 0.0, 0.0)


def _deployer(tmp: Path, agents: FakeAgents, healthy: bool) -> tuple[Deployer, DeploymentStore]:
    ca = CertificateAuthority.open(tmp)
    store = DeploymentStore(tmp)
    records = [_record(f"d{i}", 9000 + 10 * i) for i in range(3)]
    model = block_stack(6)

    def health(chain: list[Hop], plan_version: int, feeds: dict[str, Any]) -> dict[str, Any]:
        import onnxruntime as ort

        assert [h.device for h in chain] == [
            p.segment.device
            for p in sorted(
                (m for d in agents.deployed.values() for v, m in d.items() if v == plan_version),
                key=lambda m: m.segment.index,
            )
        ]
        session = ort.InferenceSession(model.SerializeToString())
        outputs = session.run(None, feeds)
        return {"x6": outputs[0] + (0.0 if healthy else 1.0)}

    deployer = Deployer(tmp, store, agents, lambda: records, list, ca.sign, health)  # type: ignore[arg-type]
    return deployer, store


def _command(tmp: Path) -> DeployCommand:
    """Deploy the stack with d0 capped just below what the whole model needs on one device."""
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    path = tmp / "stack.onnx"
    onnx.save(block_stack(6), path)
    alone = DeviceList.from_obj(
        {"devices": [{"name": "d0", "memory_bytes": 1 << 30, "gflops": 10, "bandwidth_mbps": 1}]}
    )
    whole = split_model(path, alone, tmp / "alone").manifest.segments[0].predicted_memory_bytes
    caps = {f"d{i}": whole - 1 for i in range(3)}
    return DeployCommand(model_path=path, model_id="stack", memory_caps=caps)


def test_deploy_signs_pushes_checks_and_versions(tmp_path: Path) -> None:
    agents = FakeAgents(CertificateAuthority.open(tmp_path).cert_pem, budget=64 << 20)
    deployer, store = _deployer(tmp_path, agents, healthy=True)
    first = deployer.deploy(_command(tmp_path))
    assert first.state == "active" and first.plan_version == 1
    assert len(first.segments) >= 2  # the caps leave the model no single home
    assert all(p.measured_memory_bytes == 123 and p.warmup_s > 0 for p in first.segments)
    second = deployer.deploy(_command(tmp_path))
    assert store.active("stack").plan_version == second.plan_version == 2
    assert store.model("stack").previous == 1
    third = deployer.deploy(_command(tmp_path))
    assert {v for _, v in agents.unloaded} == {1}  # retired: only the one before previous
    back = deployer.rollback("stack")
    assert back.plan_version == second.plan_version and store.model("stack").previous == 3
    assert third.plan_version == 3
    reopened = DeploymentStore(tmp_path)  # persisted atomically
    assert reopened.book() == store.book()
    assert reopened.reserve_plan_version() == 4


def test_failed_health_check_unloads_and_keeps_the_live_version(tmp_path: Path) -> None:
    agents = FakeAgents(CertificateAuthority.open(tmp_path).cert_pem, budget=64 << 20)
    deployer, _ = _deployer(tmp_path, agents, healthy=True)
    live = deployer.deploy(_command(tmp_path))
    broken, _ = _deployer(tmp_path, agents, healthy=False)
    with pytest.raises(DeployError, match="health check"):
        broken.deploy(_command(tmp_path))
    assert DeploymentStore(tmp_path).active("stack").plan_version == live.plan_version
    assert all(2 not in held for held in agents.deployed.values())


@pytest.mark.parametrize("why", [ControlErrorCode.SEGMENT_LOAD, ControlErrorCode.OVER_BUDGET])
def test_refused_push_unloads_the_others(tmp_path: Path, why: ControlErrorCode) -> None:
    """Only a refusal for memory is "no room" (which a rollout may answer by re-planning)."""
    ca_pem = CertificateAuthority.open(tmp_path).cert_pem
    agents = FakeAgents(ca_pem, 64 << 20, refuse="d1", why=why)
    deployer, store = _deployer(tmp_path, agents, healthy=True)
    with pytest.raises(DeployError, match=f"d1 refused .*{why}") as raised:
        deployer.deploy(_command(tmp_path))
    assert isinstance(raised.value, NoRoomError) == (why is ControlErrorCode.OVER_BUDGET)
    assert all(not held for held in agents.deployed.values())
    with pytest.raises(UnknownModelError):
        store.active("stack")


def test_release_unloads_a_broken_version_and_a_previous_one_that_lost_a_device(
    tmp_path: Path,
) -> None:
    """Failover frees a version that lost a device (and a rollback target that lost it too)
    on the devices left, so the re-plan has their memory; the lost device is not asked."""
    agents = FakeAgents(CertificateAuthority.open(tmp_path).cert_pem, budget=64 << 20)
    deployer, store = _deployer(tmp_path, agents, healthy=True)
    first = deployer.deploy(_command(tmp_path))
    second = deployer.deploy(_command(tmp_path))
    lost = first.segments[0].device
    assert lost in {p.device for p in second.segments}
    agents.unloaded.clear()
    deployer.release(second, {lost})
    left = {(p.device, v.plan_version) for v in (first, second) for p in v.segments}
    assert sorted(agents.unloaded) == sorted(d for d in left if d[0] != lost)
    model = store.model("stack")
    assert model.previous is None and model.active == second.version == 2
    assert [v.state for v in model.versions] == ["retired", "active"]
    with pytest.raises(RollbackError):
        store.rollback("stack")
    agents.unloaded.clear()
    third = deployer.deploy(_command(tmp_path))
    deployer.release(third, {"elsewhere"})  # the previous one (second) did not use it
    assert {v for _, v in agents.unloaded} == {third.plan_version}
    assert store.model("stack").previous == second.version
    assert (third.version, third.plan_version) == (3, 3)


def test_infeasible_plan_is_a_deploy_error(tmp_path: Path) -> None:
    agents = FakeAgents(CertificateAuthority.open(tmp_path).cert_pem, budget=100_000)
    deployer, _ = _deployer(tmp_path, agents, healthy=True)
    with pytest.raises(DeployError, match="cannot plan"):
        deployer.deploy(_command(tmp_path))


def _version(model_id: str, number: int) -> VersionRecord:
    placement = Placement(
        index=0,
        device="d0",
        host="127.0.0.1",
        control_port=1,
        data_port=2,
        sha256=SHA,
        param_bytes=1,
        predicted_memory_bytes=1,
        predicted_compute_s=0.0,
        measured_memory_bytes=1,
        warmup_s=0.0,
        load_s=0.0,
    )
    info = [TensorInfo(name="x", dtype="float32", shape=["batch", 4])]
    return VersionRecord(
        model_id=model_id,
        version=number,
        plan_version=number + 10,
        kind="encoder",
        state="active",
        created_at=0.0,
        source="m.onnx",
        objective="throughput",
        inputs=info,
        outputs=info,
        segments=[placement],
        health_max_abs_diff=0.0,
    )


def test_store_versions_and_rollback_errors(tmp_path: Path) -> None:
    store = DeploymentStore(tmp_path)
    with pytest.raises(UnknownModelError):
        store.rollback("m")
    assert store.activate(_version("m", 1), None) == []
    with pytest.raises(RollbackError):
        store.rollback("m")
    store.activate(_version("m", 2), "/tok")
    retired = store.activate(_version("m", 3), None)
    assert [(v.version, v.plan_version) for v in retired] == [(1, 11)]
    model = store.model("m")
    assert (model.active, model.previous, model.tokenizer_dir) == (3, 2, "/tok")
    assert [v.state for v in model.versions] == ["retired", "previous", "active"]
    store.rollback("m")
    assert store.active("m").version == 2
    store.rollback("m")  # and forward again
    assert store.active("m").version == 3
    with pytest.raises(StateError, match="m v3 exists already"):
        store.activate(_version("m", 3), None)
    broken = store.model("m").model_copy(update={"active": 99})
    store._put(broken)  # an active version that is not on record
    with pytest.raises(NotServableError):
        store.active("m")


class _CutRefused(Deployer):
    """A deployer whose devices refuse the version as cut; it records the fresh plan asked."""

    asked: list[DeployCommand]
    refusal: DeployError

    def _deploy_cut(self, *_: Any) -> VersionRecord:
        raise self.refusal

    def deploy(self, command: DeployCommand) -> VersionRecord:
        self.asked.append(command)
        return self._store.active(command.model_id)


NO_ROOM = NoRoomError("pushing segments failed: a: a refused (507 over_budget)")


@pytest.mark.parametrize(
    ("whole", "refusal"),
    [
        (True, NO_ROOM),
        (False, NO_ROOM),
        (True, DeployError("health check: the chain differs from the model by 3")),
    ],
)
def test_a_rollout_that_does_not_fit_as_cut_is_planned_afresh_from_its_whole_model(
    tmp_path: Path, whole: bool, refusal: DeployError
) -> None:
    """A merged LoRA version carries its whole model: when a device has no room for a changed
    segment beside the live one, it is planned like a deploy (the live version's caps and
    tokenizer kept); a version without a whole model, or one that failed for another reason
    (its health check), fails with that reason."""
    store = DeploymentStore(tmp_path)
    placement = Placement(
        index=0, device="a", host="127.0.0.1", control_port=1, data_port=1, sha256="0" * 64,
        param_bytes=1, predicted_memory_bytes=1, predicted_compute_s=0.0,
        measured_memory_bytes=1, warmup_s=0.0, load_s=0.0,
    )  # fmt: skip
    live = VersionRecord(
        model_id="m", version=1, plan_version=store.reserve_plan_version(), kind="encoder",
        state="active",
        created_at=1.0, source="m.onnx", objective="throughput",
        inputs=[TensorInfo(name="x", dtype="float32", shape=[1])],
        outputs=[TensorInfo(name="y", dtype="float32", shape=[1])],
        segments=[placement], health_max_abs_diff=0.0, memory_caps={"a": 7},
    )  # fmt: skip
    store.activate(live, "tok")
    version = tmp_path / "v0001"
    version.mkdir()
    if whole:
        (version / "model.onnx").write_bytes(b"merged")
    deployer = _CutRefused(tmp_path, store, None, list, list, bytes, None)  # type: ignore[arg-type]
    deployer.asked = []
    deployer.refusal = refusal
    if not whole or refusal is not NO_ROOM:
        with pytest.raises(DeployError, match=re.escape(str(refusal))):
            deployer.deploy_version("m", version, {}, Objective.THROUGHPUT)
        assert deployer.asked == []
        return
    assert deployer.deploy_version("m", version, {}, Objective.THROUGHPUT) == live
    [command] = deployer.asked
    assert command.model_path == version / "model.onnx" and command.model_id == "m"
    assert dict(command.memory_caps) == {"a": 7} and command.tokenizer_dir == "tok"
    assert not command.strict_caps and "507 over_budget" in command.trigger


def test_versions_kept_for_rollback_give_way_to_a_deploy_that_needs_their_memory(
    tmp_path: Path,
) -> None:
    """Two versions of one model fill the agents; another model's deploy does not fit beside
    the rollback copy, so that copy is retired and unloaded and the deploy planned again."""
    probe = FakeAgents(CertificateAuthority.open(tmp_path / "probe").cert_pem, budget=1 << 30)
    one, _ = _deployer(tmp_path / "probe", probe, healthy=True)
    one.deploy(_command(tmp_path))
    held = max(
        probe.status(AgentAddress(d, "127.0.0.1", 1)).memory_committed_bytes for d in probe.deployed
    )
    agents = FakeAgents(CertificateAuthority.open(tmp_path).cert_pem, budget=int(2.2 * held))
    deployer, store = _deployer(tmp_path, agents, healthy=True)
    first = deployer.deploy(_command(tmp_path))
    second = deployer.deploy(_command(tmp_path))
    assert store.model("stack").previous == first.version and not agents.unloaded
    other = dataclasses.replace(_command(tmp_path), model_id="other")
    deployed = deployer.deploy(other)
    assert store.active("other").plan_version == deployed.plan_version
    assert {v for _, v in agents.unloaded} == {first.plan_version}
    model = store.model("stack")
    assert model.active == second.version and model.previous is None
    assert (deployed.version, deployed.plan_version) == (1, 3)  # numbered per model
    with pytest.raises(RollbackError):
        store.rollback("stack")
    # with nothing left to give way, a deploy that does not fit fails as before
    with pytest.raises(NoFitError, match="cannot plan"):
        deployer.deploy(dataclasses.replace(_command(tmp_path), model_id="third"))
    assert store.active("stack").plan_version == second.plan_version
