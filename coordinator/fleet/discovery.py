"""Discovery of agents over mDNS with zeroconf: the only module that talks to zeroconf.

:class:`ZeroconfDiscovery` browses ``_fedshard._tcp.local.`` on one interface and feeds a
:class:`~coordinator.fleet.registry.DeviceRegistry`. A record whose TXT cannot be decoded is logged
and ignored; the browser keeps running for everyone else.

Every :data:`DISCOVERY_INTERVAL_S` a maintenance thread asks again for the names of paired
devices whose contested instance name departed (the registry keeps them online, unconfirmed:
see :mod:`coordinator.fleet.registry`), once the goodbye's records have left zeroconf's cache
(:data:`GOODBYE_S`), with a fresh browse so the browser sees the device's pointer record again;
and it expires the registry's stale records.
"""

from __future__ import annotations

import logging
import threading
import time

from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

from coordinator.config import Timeouts
from coordinator.fleet.registry import DeviceRegistry
from protocols.constants import SERVICE_TYPE
from protocols.errors import TxtRecordError
from protocols.txt import decode_txt

log = logging.getLogger(__name__)
DISCOVERY_INTERVAL_S = 1.0
GOODBYE_S = 1.2
"""zeroconf keeps a goodbye's records for 1 s (RFC 6762 10.1); names are asked again after."""
ANSWER_S = 0.5
"""How long a fresh browse's answers are awaited before the names are resolved."""


class ZeroconfDiscovery:
    """Browses for agents on ``interface`` and keeps ``registry`` up to date."""

    def __init__(
        self, registry: DeviceRegistry, interface: str, timeouts: Timeouts | None = None
    ) -> None:
        self._registry = registry
        self._resolve_ms = int((timeouts or Timeouts()).mdns_resolve_s * 1000)
        self._zeroconf = Zeroconf(interfaces=[interface], ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        self._departed: dict[str, float] = {}
        """Contested names that departed -> when (monotonic), until they are asked again."""
        self._asking: ServiceBrowser | None = None
        """A fresh browse while names are asked again, so answers bring their pointers back."""
        self._asking_until = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._maintenance = threading.Thread(target=self._maintain, name="discovery", daemon=True)
        self._maintenance.start()

    def close(self) -> None:
        """Stop browsing and release the sockets."""
        self._stop.set()
        self._maintenance.join(10.0)
        if self._asking is not None:
            self._asking.cancel()
        self._browser.cancel()
        self._zeroconf.close()

    def recheck(self) -> None:
        """Ask again for departed contested names past :data:`GOODBYE_S`; expire stale records."""
        now = time.monotonic()
        with self._lock:
            due = [name for name, at in self._departed.items() if now - at >= GOODBYE_S]
            for name in due:
                del self._departed[name]
            waiting = set(self._departed)
        due += [n for n in self._registry.unconfirmed() if n not in due and n not in waiting]
        if self._asking is not None and now >= self._asking_until:
            self._asking.cancel()
            self._asking = None
        if due:
            if self._asking is None:  # its first query goes out after 20-120 ms
                self._asking = ServiceBrowser(self._zeroconf, SERVICE_TYPE, handlers=[_ignore])
                self._stop.wait(ANSWER_S)  # so the browser holds the pointers when names confirm
            self._asking_until = now + 2 * DISCOVERY_INTERVAL_S
            for name in due:
                self._resolve(SERVICE_TYPE, name)
        self._registry.expire()

    def _maintain(self) -> None:
        while not self._stop.wait(DISCOVERY_INTERVAL_S):
            try:
                self.recheck()
            except Exception:  # discovery must outlive any one bad round
                log.exception("discovery maintenance failed")

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
            if self._registry.depart(name):
                with self._lock:
                    self._departed[name] = time.monotonic()
            return
        self._resolve(service_type, name)

    def _resolve(self, service_type: str, name: str) -> None:
        info = self._zeroconf.get_service_info(service_type, name, timeout=self._resolve_ms)
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


def _ignore(
    zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
) -> None:
    """The re-asking browser's handler: its answers reach the main browser through the cache."""
