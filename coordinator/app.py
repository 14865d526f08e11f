"""The coordinator process: CA, pairing, discovery, deployments, data plane, HTTP API.

Everything is built once here from the :class:`~coordinator.config.CoordinatorConfig` and torn
down in reverse order when uvicorn stops (SIGINT or SIGTERM).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

from rich.console import Console

from coordinator.config import CoordinatorConfig
from coordinator.deploy.deployer import Deployer
from coordinator.deploy.stage_timing import StageTiming
from coordinator.deploy.store import DeploymentStore
from coordinator.fleet.discovery import ZeroconfDiscovery
from coordinator.fleet.links import LinkMeter
from coordinator.fleet.liveness import Liveness
from coordinator.fleet.registry import DeviceRecord, DeviceRegistry
from coordinator.fleet.requester_links import requester_probe
from coordinator.http.app import Services, create_app
from coordinator.http.server import api_server
from coordinator.http.serving import Serving
from coordinator.serving.decoder import DecoderModels, planned_context, rows_exact_on
from coordinator.serving.embeddings import Embedder
from coordinator.serving.failover import Failover
from coordinator.serving.router import Router
from coordinator.training.target import PairedAgents, coordinator_runs
from coordinator.transport.agent_client import AgentClient
from coordinator.transport.dataplane import DataPlane
from coordinator.transport.tls import client_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.delivery import TrustService, address_of
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing
from hostkit.files import sweep_temp_files

log = logging.getLogger(__name__)


def serve(config: CoordinatorConfig, console: Console) -> int:
    """Run the coordinator until interrupted; returns the exit code."""
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for leftover in sweep_temp_files(config.state_dir):
        log.warning("removed %s, left by a write that a crash interrupted", leftover.name)
    ca = CertificateAuthority.open(config.state_dir)
    ctx = client_context(open_identity(config.state_dir, ca))
    pairing = Pairing(config.state_dir, ca)
    registry = DeviceRegistry(paired_fingerprint=pairing.fingerprint_of, timeouts=config.timeouts)
    agents = AgentClient(ctx, config.timeouts)
    trust = TrustService(pairing, registry, ca, agents, config.timeouts, config.retries)
    store = DeploymentStore(config.state_dir)
    plane = DataPlane(config.timeouts)
    # failover, router, liveness and deployer need one another: late-bound through lambdas
    failover = Failover(
        store,
        replan=lambda version, why: deployer.replan(version, why),
        abort=lambda plan_version, why: router.abort(plan_version, why),
        probe=lambda names: liveness.probe(names),
        release=lambda version, lost: deployer.release(version, lost),
        retries=config.retries,
    )
    router = Router(
        store, plane, ctx, lambda: pairing.book().revoked_names, failover, config.timeouts
    )
    liveness = Liveness(
        trust.trusted,
        failover.expected_devices,
        lambda record, timeout: agents.status(address_of(record), timeout),
        failover,
        busy=lambda: deployer.busy_devices(),
        timeouts=config.timeouts,
        retries=config.retries,
    )

    def live() -> list[DeviceRecord]:
        return [r for r in trust.trusted() if liveness.alive(r.name)]

    links = LinkMeter(agents, live, requester_probe(plane, ctx, config.timeouts))
    deployer = Deployer(
        config.state_dir,
        store,
        agents,
        live,
        lambda: links.measure(only_missing=True),
        ca.sign,
        router.health,
        router.retire,
        links.requester_links,
        config.segment_cache_dir,
        StageTiming(config.state_dir),
    )
    serving = Serving(store, deployer, router, Embedder(store, router), links, failover)
    generation = DecoderModels(
        store,
        plane,
        router.chain_client,
        router.chain_failed,
        planned_context(deployer.segment_dir),
        rows_exact_on(registry),
        config.draft_threads,
        config.timeouts,
    )
    app = create_app(
        Services(
            config.token,
            registry,
            pairing,
            trust,
            serving,
            agents=agents,
            state_dir=config.state_dir,
            training=coordinator_runs(
                config.state_dir,
                ca,
                deployer,
                store,
                config.training_target,
                _paired_agents(config, pairing, agents, live),
            ),
            generation=generation,
            speculation=generation.speculation_stats.get,
            speculation_off=generation.speculation_off,
            open_docs=config.open_docs,
        )
    )
    server = api_server(app, config.api_host, config.port)
    discovery = ZeroconfDiscovery(registry, config.interface, config.timeouts)
    try:
        trust.start()
        failover.start()
        liveness.start()
        console.print(f"console: {config.console_url}", soft_wrap=True)
        console.print("a host firewall must let in:", soft_wrap=True)
        for line in config.firewall_ports():
            console.print(f"  {line}", soft_wrap=True, markup=False)
        log.info("coordinator listening on %s:%d", config.api_host, config.port)
        with _signals_absorbed():
            server.run()
        log.info("coordinator stopping")
    finally:
        trust.stop()
        liveness.stop()
        failover.stop()
        discovery.close()
        router.close()
        plane.close()
    return 0


def _paired_agents(
    config: CoordinatorConfig,
    pairing: Pairing,
    client: AgentClient,
    live: Callable[[], list[DeviceRecord]],
) -> PairedAgents | None:
    """The agents API training runs go to (None: local SuperNodes on the reference data)."""
    if config.agent_training is None:
        return None
    return PairedAgents(
        config.agent_training,
        config.interface,
        pairing.node_keys,
        client,
        lambda: [address_of(r) for r in live()],
    )


@contextlib.contextmanager
def _signals_absorbed() -> Iterator[None]:
    """Let uvicorn handle SIGINT/SIGTERM, then carry on to an orderly shutdown.

    uvicorn re-raises the signal it caught once it has stopped, to the handler that was
    installed before it; with the default one the process would die before withdrawing from
    mDNS and closing its connections. This handler only records the signal.
    """
    caught: list[int] = []
    previous = {
        number: signal.signal(number, lambda signum, frame: caught.append(signum))
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            log.info("stopped by signal %d", caught[0])
