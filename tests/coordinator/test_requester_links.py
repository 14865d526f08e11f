"""The coordinator measures its own link to each agent (input in, result back) for the planner.

A real agent process on 127.0.0.1 answers the coordinator's probe frames over mutual TLS; the
measured link reaches ``DEVICES.json``'s ``requester`` through the link meter and
:func:`coordinator.deploy.plan.device_list`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import AgentProc, TestCA, start_agent, stop_agent
from coordinator_helpers import free_port, paired_record

from coordinator.errors import AgentError
from coordinator.fleet.requester_links import probe_agent, requester_probe
from coordinator.transport.dataplane import DataPlane
from protocols.deploy import Hop


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProc, TestCA]]:
    tmp = tmp_path_factory.mktemp("requester-links")
    ca = TestCA(tmp / "ca")
    started = start_agent(tmp, "edge-1", ca)
    try:
        yield started, ca
    finally:
        stop_agent(started)


@pytest.fixture
def plane() -> Iterator[DataPlane]:
    dataplane = DataPlane()
    try:
        yield dataplane
    finally:
        dataplane.close()


def test_probe_measures_the_link_to_the_agent(
    agent: tuple[AgentProc, TestCA], plane: DataPlane
) -> None:
    proc, ca = agent
    ctx = ca.client_context("coordinator")
    link = plane.call(probe_agent(proc.hop, ctx, payload_bytes=256 << 10, rounds=4), 60)
    assert link.device == "edge-1"
    assert math.isfinite(link.bandwidth_mbps) and link.bandwidth_mbps > 0
    assert math.isfinite(link.latency_ms) and link.latency_ms > 0


def test_probe_refuses_an_agent_under_another_name(
    agent: tuple[AgentProc, TestCA], plane: DataPlane
) -> None:
    proc, ca = agent
    impostor = Hop(device="edge-2", host="127.0.0.1", data_port=proc.data_port)
    with pytest.raises(AgentError):
        plane.call(probe_agent(impostor, ca.client_context("coordinator")), 60)


def test_probe_of_a_closed_port_is_an_agent_error(tmp_path: Path, plane: DataPlane) -> None:
    ca = TestCA(tmp_path / "ca")
    nobody = Hop(device="edge-9", host="127.0.0.1", data_port=free_port())
    with pytest.raises(AgentError, match="cannot reach"):
        plane.call(probe_agent(nobody, ca.client_context("coordinator")), 60)


def test_measured_links_reach_the_planners_device_list(
    agent: tuple[AgentProc, TestCA], plane: DataPlane
) -> None:
    from coordinator.deploy.plan import LiveDevice, device_list
    from coordinator.fleet.links import LinkMeter
    from coordinator.transport.agent_client import AgentClient

    proc, ca = agent
    ctx = ca.client_context("coordinator")
    record = paired_record(proc)
    meter = LinkMeter(AgentClient(ctx), lambda: [record], requester_probe(plane, ctx))
    assert meter.measure() == []  # one agent: no link between agents
    (measured,) = meter.requester_links()
    assert measured.device == proc.name
    live = LiveDevice(proc.name, 256 << 20, 0, 10.0, "127.0.0.1", proc.control_port, 0)
    listed = device_list([live], [], {}, requester=meter.requester_links())
    assert listed.requester is not None and listed.requester.links == [measured]
    assert device_list([live], [], {}).requester is None


def test_probe_estimate_takes_medians_and_subtracts_the_small_round_trip() -> None:
    from protocols.links import probe_estimate

    latency_ms, bandwidth_mbps = probe_estimate([0.002, 0.002, 0.5], [0.010, 0.010], 1_000_000)
    assert latency_ms == pytest.approx(1.0)  # half the median small round trip
    assert bandwidth_mbps == pytest.approx(1000.0)  # 8 Mbit in 8 ms
