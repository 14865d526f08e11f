"""Link measurement between paired agents (through their ``POST /v1/probe``) and to them.

For each pair of trusted online agents, the first (by name) probes the second's data plane:
round trips of header-only frames give the latency, one large frame the bandwidth. The results
are kept per pair and given to the planner as ``DEVICES.json`` links. With a requester probe
(:func:`coordinator.fleet.requester_links.probe_agent`), the coordinator's own link to each agent is
measured too, and given to the planner as ``DEVICES.json``'s ``requester``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

from coordinator.errors import AgentError
from coordinator.fleet.registry import DeviceRecord
from coordinator.transport.agent_client import AgentAddress, AgentClient
from protocols.deploy import Hop
from protocols.links import Link as DeviceLink
from protocols.links import RequesterLink

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 20
MIN_BANDWIDTH_MBPS = 0.001


RequesterProbe = Callable[[DeviceRecord], RequesterLink]
"""Measures the coordinator's link to one agent; raises :class:`AgentError`."""


class LinkMeter:
    """Measured links by unordered device pair, and from the coordinator by device."""

    def __init__(
        self,
        agents: AgentClient,
        trusted: Callable[[], list[DeviceRecord]],
        probe_requester: RequesterProbe | None = None,
    ) -> None:
        self._agents = agents
        self._trusted = trusted
        self._probe_requester = probe_requester
        self._links: dict[frozenset[str], DeviceLink] = {}
        self._requester: dict[str, RequesterLink] = {}
        self._lock = threading.Lock()

    def links(self) -> list[DeviceLink]:
        """Every link between agents measured so far."""
        with self._lock:
            return sorted(self._links.values(), key=lambda link: (link.a, link.b))

    def requester_links(self) -> list[RequesterLink]:
        """Every link from the coordinator to an agent measured so far."""
        with self._lock:
            return sorted(self._requester.values(), key=lambda link: link.device)

    def measure(self, only_missing: bool = False) -> list[DeviceLink]:
        """Probe every pair of trusted online agents, and the coordinator's link to each (or only
        links not measured yet); the links between agents."""
        records = sorted(self._trusted(), key=lambda r: r.name)
        self._measure_requester(records, only_missing)
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

    def _measure_requester(self, records: list[DeviceRecord], only_missing: bool) -> None:
        if self._probe_requester is None:
            return
        for record in records:
            if only_missing and record.name in self._requester:
                continue
            try:
                link = self._probe_requester(record)
            except AgentError as exc:
                log.warning("could not measure the link to %s: %s", record.name, exc)
                continue
            with self._lock:
                self._requester[record.name] = link

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
