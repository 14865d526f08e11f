"""Discovery of agents over mDNS with zeroconf: the only module that talks to zeroconf.

:class:`ZeroconfDiscovery` browses ``_fedshard._tcp.local.`` on one interface and feeds a
:class:`~coordinator.fleet.registry.DeviceRegistry`. A record whose TXT cannot be decoded is logged
and ignored; the browser keeps running for everyone else.
"""

from __future__ import annotations

import logging

from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

from coordinator.fleet.registry import DeviceRegistry
from protocols.constants import SERVICE_TYPE
from protocols.errors import TxtRecordError
from protocols.txt import decode_txt

log = logging.getLogger(__name__)
RESOLVE_TIMEOUT_MS = 2000


class ZeroconfDiscovery:
    """Browses for agents on ``interface`` and keeps ``registry`` up to date."""

    def __init__(self, registry: DeviceRegistry, interface: str) -> None:
        self._registry = registry
        self._zeroconf = Zeroconf(interfaces=[interface], ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zeroconf, SERVICE_TYPE, handlers=[self._on_change])

    def close(self) -> None:
        """Stop browsing and release the sockets."""
        self._browser.cancel()
        self._zeroconf.close()

    def __enter__(self) -> ZeroconfDiscovery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            self._registry.depart(name)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=RESOLVE_TIMEOUT_MS)
        if info is None:
            log.warning("could not resolve %s", name)
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses:
            log.warning("%s announced no IPv4 address", name)
            return
        try:
            announcement = decode_txt(info.properties)
        except TxtRecordError as exc:
            log.warning("ignoring %s: %s", name, exc)
            return
        self._registry.announce(announcement, host=addresses[0], service_name=name)
