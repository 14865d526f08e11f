"""The coordinator's waits and retries are configuration (:class:`~coordinator.config.Timeouts`,
:class:`~coordinator.config.Retries`): built with :class:`~coordinator.config.CoordinatorConfig`
and handed to what waits, with the values the constants they replace had."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig, Retries, Timeouts
from coordinator.deploy.store import DeploymentStore
from coordinator.errors import AgentError
from coordinator.serving.decoder import ChainDecoderBackend
from coordinator.serving.failover import Failover
from coordinator.transport.agent_client import AgentAddress, AgentClient
from coordinator.transport.dataplane import DataPlane


def test_the_defaults_are_the_waits_the_coordinator_always_had() -> None:
    config = CoordinatorConfig(Path("state"))
    assert config.timeouts == Timeouts(
        request_s=60.0,
        step_s=60.0,
        recovery_s=60.0,
        connect_s=10.0,
        agent_call_s=30.0,
        agent_deploy_s=1800.0,
        agent_metrics_s=10.0,
    )
    assert config.retries == Retries(unavailable_s=15.0)


def test_what_waits_takes_its_wait_from_the_configuration(tmp_path: Path) -> None:
    failover = Failover(
        DeploymentStore(tmp_path),
        replan=lambda version, why: version,
        abort=lambda plan_version, why: None,
        probe=lambda names: {},
        release=lambda version, lost: None,
        retries=Retries(unavailable_s=2.5),
    )
    assert failover.retry_after() == 2.5
    backend = ChainDecoderBackend(
        plane=None,  # type: ignore[arg-type]  # never stepped here
        client_of=lambda deadline: None,  # type: ignore[arg-type,return-value]
        failed=lambda version, error: None,
        timeouts=Timeouts(step_s=7.0, recovery_s=9.0),
    )
    assert (backend._timeout, backend._recovery_s) == (7.0, 9.0)
    plane = DataPlane(Timeouts(connect_s=3.0))
    try:
        assert plane.connect_s == 3.0
    finally:
        plane.close()


def test_an_agent_call_waits_the_configured_time() -> None:
    """A host that accepts the connection and never answers: the call gives up after the
    configured agent call time, as an AgentError (the test's own timeout would catch a hang)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        agents = AgentClient(ssl.create_default_context(), Timeouts(agent_call_s=0.5))
        with pytest.raises(AgentError):
            agents.status(AgentAddress("a0", "127.0.0.1", port))
