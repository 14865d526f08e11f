"""The request guard's contract (:class:`coordinator.serving.router.Guard`), held by every
implementation: :class:`~coordinator.serving.router.NoFailover` and
:class:`~coordinator.serving.failover.Failover`, each over a real deployment store.

One suite parametrised over the implementations (as Flower tests every state of its links):
the version to send to is the active one while nothing failed, an unknown model is refused
with the same typed error by each, a failure on a chain whose devices all still hold their
segments leaves the version usable and current, and a version no store knows is not made
current by a failure report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
from contract_helpers import implementations

from coordinator.deploy.store import DeploymentStore, Placement, VersionRecord
from coordinator.errors import ChainBrokenError, UnknownModelError
from coordinator.serving.failover import Failover
from coordinator.serving.router import Guard, NoFailover
from protocols.deploy import AgentStatus, DeployReport, LoadedSegment
from protocols.manifest import TensorInfo

SHA = "ab" * 32
DEVICES = ["a", "b"]
IO = [TensorInfo(name="x", dtype="float32", shape=["batch", 4])]


def _version(plan_version: int) -> VersionRecord:
    placements = [
        Placement(
            index=i,
            device=device,
            host="127.0.0.1",
            control_port=1,
            data_port=1,
            sha256=SHA,
            param_bytes=1,
            predicted_memory_bytes=1,
            predicted_compute_s=0.0,
            measured_memory_bytes=1,
            warmup_s=0.0,
            load_s=0.0,
        )
        for i, device in enumerate(DEVICES)
    ]
    fields = {
        "model_id": "enc",
        "version": 1,
        "plan_version": plan_version,
        "kind": "encoder",
        "state": "active",
        "created_at": 100.0,
        "source": "enc.onnx",
        "objective": "throughput",
        "inputs": IO,
        "outputs": [TensorInfo(name="y", dtype="float32", shape=["batch", 4])],
        "segments": placements,
        "health_max_abs_diff": 0.0,
        "memory_caps": dict.fromkeys(DEVICES, 1),
    }
    # the fields this store's records have (the per-model number and kind came with issue 38)
    known = {k: v for k, v in fields.items() if k in VersionRecord.model_fields}
    return VersionRecord.model_validate(known)


def _holding(name: str, plan_version: int) -> AgentStatus:
    report = DeployReport(
        device=name,
        plan_version=plan_version,
        segment_sha256=SHA,
        predicted_memory_bytes=1,
        measured_memory_bytes=1,
        predicted_compute_s=0.0,
        load_s=0.0,
        warmup_first_s=0.0,
        warmup_s=0.0,
    )
    loaded = LoadedSegment(
        report=report, deployment=f"enc@{plan_version}", segment_index=0, chain_length=2
    )
    return AgentStatus(
        name=name,
        device_id="0" * 32,
        memory_budget_bytes=1 << 30,
        memory_committed_bytes=0,
        resident_memory_bytes=0,
        gflops=1.0,
        paired=True,
        segments=[loaded],
    )


def _no_failover(store: DeploymentStore, plan_version: int) -> Guard:
    return NoFailover(store)


def _failover(store: DeploymentStore, plan_version: int) -> Guard:
    def probe(names: Collection[str]) -> dict[str, AgentStatus | None]:
        return {name: _holding(name, plan_version) for name in names}  # every device answers

    def never(*_: object) -> None:
        raise AssertionError("nothing was lost: no re-plan, abort or release")

    return Failover(store, replan=never, abort=never, probe=probe, release=never)


GUARDS: dict[str, Callable[[DeploymentStore, int], Guard]] = {
    "no-failover": _no_failover,
    "failover": _failover,
}


@pytest.fixture(params=sorted(GUARDS))
def served(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Guard, VersionRecord]:
    store = DeploymentStore(tmp_path)
    version = _version(store.reserve_plan_version())
    store.activate(version, None)
    return GUARDS[request.param](store, version.plan_version), store.active("enc")


def _soon() -> float:
    return time.monotonic() + 5.0


def test_the_active_version_is_current_and_usable(served: tuple[Guard, VersionRecord]) -> None:
    guard, active = served
    assert guard.current("enc", _soon()) == active
    assert guard.usable(active.plan_version)


def test_an_unknown_model_is_refused_with_the_same_typed_error(
    served: tuple[Guard, VersionRecord],
) -> None:
    guard, _ = served
    with pytest.raises(UnknownModelError):
        guard.current("nope", _soon())


def test_a_transient_failure_leaves_the_version_usable_and_current(
    served: tuple[Guard, VersionRecord],
) -> None:
    guard, active = served
    guard.failed(active, ChainBrokenError("the connection to b dropped"))
    assert guard.usable(active.plan_version)
    assert guard.current("enc", _soon()) == active


def test_every_guard_in_the_serving_room_is_in_the_suite() -> None:
    """A new guard (a class of :mod:`coordinator.serving` with the Guard's three methods) joins
    :data:`GUARDS`, so that it is held to the same contract."""
    found = implementations("coordinator.serving", ("current", "failed", "usable"))
    assert found == {NoFailover, Failover}, f"add {found - {NoFailover, Failover}} to GUARDS"
