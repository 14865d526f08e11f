"""The coordinator process: CA, pairing, discovery, deployments, data plane, HTTP API.

Everything is built once here from the :class:`~coordinator.config.CoordinatorConfig` and torn
down in reverse order when uvicorn stops (SIGINT or SIGTERM).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

from rich.console import Console

from coordinator.agent_client import AgentClient
from coordinator.api import Services, create_app
from coordinator.api_serving import Serving
from coordinator.ca import CertificateAuthority
from coordinator.config import CoordinatorConfig
from coordinator.dataplane import DataPlane
from coordinator.deployer import Deployer
from coordinator.deployments import DeploymentStore
from coordinator.discovery import ZeroconfDiscovery
from coordinator.embeddings import Embedder
from coordinator.identity import client_context, open_identity
from coordinator.links import LinkMeter
from coordinator.pairing import Pairing
from coordinator.registry import DeviceRegistry
from coordinator.serving import Router
from coordinator.trust import TrustService

log = logging.getLogger(__name__)


def serve(config: CoordinatorConfig, console: Console) -> int:
    """Run the coordinator until interrupted; returns the exit code."""
    import uvicorn

    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca = CertificateAuthority.open(config.state_dir)
    ctx = client_context(open_identity(config.state_dir, ca))
    pairing = Pairing(config.state_dir, ca)
    registry = DeviceRegistry()
    agents = AgentClient(ctx)
    trust = TrustService(pairing, registry, ca, agents)
    store = DeploymentStore(config.state_dir)
    plane = DataPlane()
    router = Router(store, plane, ctx, lambda: pairing.book().revoked_names)
    links = LinkMeter(agents, trust.trusted)
    deployer = Deployer(
        config.state_dir,
        store,
        agents,
        trust.trusted,
        lambda: links.measure(only_missing=True),
        ca.sign,
        router.health,
        router.retire,
    )
    serving = Serving(store, deployer, router, Embedder(store, router), links)
    app = create_app(Services(config.token, registry, pairing, trust, serving))
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.interface, port=config.port, log_level="warning")
    )
    discovery = ZeroconfDiscovery(registry, config.interface)
    try:
        trust.start()
        console.print(f"console: {config.console_url}", soft_wrap=True)
        log.info("coordinator listening on %s:%d", config.interface, config.port)
        with _signals_absorbed():
            server.run()
        log.info("coordinator stopping")
    finally:
        trust.stop()
        discovery.close()
        router.close()
        plane.close()
    return 0


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
