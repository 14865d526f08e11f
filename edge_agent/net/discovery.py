"""Discovery over mDNS: the only module that touches zeroconf.

:class:`Advertiser` and :class:`Browser` are the interfaces the rest of the agent (and tests)
use; the zeroconf implementations bind only to the configured interface, IPv4.
The service instance is ``NAME-<8 hex of device id>._fedshard._tcp.local.``; its SRV port is
the control port; the TXT record is :func:`protocols.txt.encode_txt` of the announcement.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from protocols.constants import SERVICE_TYPE
from protocols.errors import TxtRecordError
from protocols.profile import Announcement
from protocols.txt import decode_txt, encode_txt

log = logging.getLogger(__name__)


class Advertiser(Protocol):
    """Announces this agent, re-announces on change, withdraws on close."""

    async def start(self, announcement: Announcement) -> None:
        """Register the service."""
        ...

    async def update(self, announcement: Announcement) -> None:
        """Re-announce with a new TXT record."""
        ...

    async def close(self) -> None:
        """Unregister (sends goodbye packets) and release the sockets."""
        ...


def instance_name(announcement: Announcement) -> str:
    """The DNS-SD instance name of an agent."""
    profile = announcement.profile
    return f"{profile.name}-{profile.device_id[:8]}.{SERVICE_TYPE}"


class ZeroconfAdvertiser:
    """:class:`Advertiser` with zeroconf's asyncio API, bound to one IPv4 interface."""

    def __init__(self, interface: str) -> None:
        self._interface = interface
        self._zc: Any = None
        self._info: Any = None

    def _service_info(self, announcement: Announcement) -> Any:
        from zeroconf import ServiceInfo

        profile = announcement.profile
        return ServiceInfo(
            SERVICE_TYPE,
            instance_name(announcement),
            addresses=[socket.inet_aton(self._interface)],
            port=profile.control_port,
            properties=encode_txt(announcement),
            server=f"{profile.name}-{profile.device_id[:8]}.local.",
        )

    async def start(self, announcement: Announcement) -> None:
        """Register the service on the interface."""
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncZeroconf

        self._zc = AsyncZeroconf(interfaces=[self._interface], ip_version=IPVersion.V4Only)
        self._info = self._service_info(announcement)
        # zeroconf's async calls return a task that finishes once the packets are out
        await (await self._zc.async_register_service(self._info))
        log.info("advertising %s on %s", self._info.name, self._interface)

    async def update(self, announcement: Announcement) -> None:
        """Re-announce the service with the new TXT record."""
        if self._zc is None:
            return
        self._info = self._service_info(announcement)
        await (await self._zc.async_update_service(self._info))

    async def close(self) -> None:
        """Unregister and close."""
        if self._zc is None:
            return
        zc, info = self._zc, self._info
        self._zc = self._info = None
        await (await zc.async_unregister_service(info))
        await zc.async_close()
        log.info("withdrew %s", info.name)


class Browser(Protocol):
    """Keeps a live view of the agents announced on the network."""

    def snapshot(self) -> dict[str, Announcement]:
        """Current agents by instance name (those whose TXT record decodes)."""
        ...

    def close(self) -> None:
        """Stop browsing."""
        ...


class ZeroconfBrowser:
    """:class:`Browser` with zeroconf's threaded API (usable from plain synchronous code)."""

    def __init__(self, interface: str) -> None:
        from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf

        self._zc = Zeroconf(interfaces=[interface], ip_version=IPVersion.V4Only)
        self._names: set[str] = set()
        self._lock = threading.Lock()
        added, updated = ServiceStateChange.Added, ServiceStateChange.Updated

        def on_change(
            zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange
        ) -> None:
            with self._lock:
                if state_change in (added, updated):
                    self._names.add(name)
                else:
                    self._names.discard(name)

        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[on_change])

    def snapshot(self) -> dict[str, Announcement]:
        """Resolve every known instance's TXT record (from zeroconf's cache, else the network)."""
        with self._lock:
            names = sorted(self._names)
        found: dict[str, Announcement] = {}
        for name in names:
            info = self._zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
            if info is None:
                continue
            try:
                found[name] = decode_txt(info.properties)
            except TxtRecordError as exc:
                log.warning("ignoring %s: %s", name, exc)
        return found

    def wait_for(
        self, predicate: Callable[[dict[str, Announcement]], bool], timeout_s: float
    ) -> dict[str, Announcement]:
        """Poll :meth:`snapshot` until ``predicate`` holds; returns the last snapshot."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.snapshot()
            if predicate(current) or time.monotonic() > deadline:
                return current
            time.sleep(0.1)

    def close(self) -> None:
        """Stop browsing and close zeroconf."""
        self._browser.cancel()
        self._zc.close()
