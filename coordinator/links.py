"""Link measurement between paired agents, through their ``POST /v1/probe``.

For each pair of trusted online agents, the first (by name) probes the second's data plane:
round trips of header-only frames give the latency, one large frame the bandwidth. The results
are kept per pair and given to the planner as ``DEVICES.json`` links.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

from coordinator.agent_client import AgentAddress, AgentClient
from coordinator.errors import AgentError
from coordinator.registry import DeviceRecord
from protocols.deploy import Hop
from protocols.links import Link as DeviceLink

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 20
MIN_BANDWIDTH_MBPS = 0.001


class LinkMeter:
    """Measured links by unordered device pair."""

    def __init__(self, agents: AgentClient, trusted: Callable[[], list[DeviceRecord]]) -> None:
        self._agents = agents
        self._trusted = trusted
        self._links: dict[frozenset[str], DeviceLink] = {}
        self._lock = threading.Lock()

    def links(self) -> list[DeviceLink]:
        """Every link measured so far."""
        with self._lock:
            return sorted(self._links.values(), key=lambda link: (link.a, link.b))

    def measure(self, only_missing: bool = False) -> list[DeviceLink]:
        """Probe every pair of trusted online agents (or only pairs not measured yet)."""
        records = sorted(self._trusted(), key=lambda r: r.name)
        for a, b in itertools.combinations(records, 2):
            pair = frozenset((a.name, b.name))
            if only_missing and pair in self._links:
                continue
            try:
                link = self._probe(a, b)
            except AgentError as exc:
                log.warning("could not measure the link %s-%s: %s", a.name, b.name, exc)
                continue
            with self._lock:
                self._links[pair] = link
        return self.links()

    def _probe(self, a: DeviceRecord, b: DeviceRecord) -> DeviceLink:
        source = AgentAddress(a.name, a.host, a.announcement.profile.control_port)
        target = Hop(device=b.name, host=b.host, data_port=b.announcement.profile.data_port)
        report = self._agents.probe(source, target, PROBE_BYTES)
        return DeviceLink(
            a=a.name,
            b=b.name,
            bandwidth_mbps=max(report.bandwidth_mbps, MIN_BANDWIDTH_MBPS),
            latency_ms=report.latency_ms,
        )
