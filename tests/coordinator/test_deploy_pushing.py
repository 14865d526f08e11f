"""Pushing segments: hosts in parallel, the agents of one host one after another."""

from __future__ import annotations

import threading
from collections import Counter

from coordinator.deploy.pushing import push_per_host
from coordinator.errors import AgentError
from coordinator.transport.agent_client import AgentAddress
from protocols.deploy import DeployReport


def _report(device: str) -> DeployReport:
    return DeployReport(
        device=device,
        plan_version=1,
        segment_sha256="0" * 64,
        predicted_memory_bytes=1,
        measured_memory_bytes=1,
        predicted_compute_s=0.1,
        load_s=0.0,
        warmup_first_s=0.0,
        warmup_s=0.0,
    )


def test_agents_of_one_host_are_pushed_in_turn_and_hosts_at_once() -> None:
    addresses = [
        AgentAddress("a1", "10.0.0.1", 1),
        AgentAddress("b1", "10.0.0.2", 1),
        AgentAddress("a2", "10.0.0.1", 2),
        AgentAddress("a3", "10.0.0.1", 3),
        AgentAddress("b2", "10.0.0.2", 2),
    ]
    both_hosts = threading.Barrier(2, timeout=10)  # the hosts' first pushes meet here
    lock = threading.Lock()
    in_flight: Counter[str] = Counter()
    most: Counter[str] = Counter()
    order: list[str] = []

    def deploy(address: AgentAddress, body: bytes) -> DeployReport:
        with lock:
            in_flight[address.host] += 1
            most[address.host] = max(most[address.host], in_flight[address.host])
            order.append(address.device)
        if address.device in {"a1", "b1"}:
            both_hosts.wait()
        with lock:
            in_flight[address.host] -= 1
        if address.device == "a2":
            raise AgentError("a2 is gone")
        assert body == address.device.encode()
        return _report(address.device)

    outcomes = push_per_host(deploy, addresses, [a.device.encode() for a in addresses])
    assert [o.device if isinstance(o, DeployReport) else str(o) for o in outcomes] == [
        "a1",
        "b1",
        "a2 is gone",
        "a3",
        "b2",
    ]
    assert most == {"10.0.0.1": 1, "10.0.0.2": 1}  # never two agents of one host at once
    assert [d for d in order if d.startswith("a")] == ["a1", "a2", "a3"]  # a failure goes on
