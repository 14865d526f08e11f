"""Process-level wiring of ``fedshard agent``: signals, identity, profile, the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

from edge_agent.config import AgentConfig
from edge_agent.net.discovery import ZeroconfAdvertiser
from edge_agent.profile.microbench import load_or_measure
from edge_agent.runtime.engine import prime
from edge_agent.serve.agent import Agent
from edge_agent.trust.identity import load_identity
from edge_agent.trust.pairing import stored_tls

log = logging.getLogger(__name__)


def serve(config: AgentConfig) -> int:
    """Run the agent until SIGTERM or Ctrl-C; returns the exit code."""
    if config.tls is None and (stored := stored_tls(config.state_dir)) is not None:
        config = dataclasses.replace(config, tls=stored)
    identity = load_identity(config)
    profile = load_or_measure(config.state_dir, config.runtime, remeasure=config.reprofile)
    prime(config.runtime)
    advertiser = ZeroconfAdvertiser(config.interface) if config.advertise else None
    agent = Agent(config, identity, profile, advertiser)
    asyncio.run(_main(agent))
    return 0


async def _main(agent: Agent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.run(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
