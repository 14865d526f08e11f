"""The live device registry: what the coordinator knows of each agent it has heard announce.

Devices are keyed by their certificate fingerprint, never by advertised name: a second device
announcing a name already taken by another key is kept apart and flagged as an impostor, and
cannot take the first one's place. Who owns a name is, for a paired name, the certificate it was
paired with (``paired_fingerprint``, asked at every read), whoever announced first; otherwise the
first device seen with it. mDNS is unauthenticated, so these flags are for the operator: whether
a device is *used* is decided by the pairing book (see
:class:`coordinator.trust.delivery.TrustService`).
The registry is fed by a discovery source (see :mod:`coordinator.fleet.discovery`) and is safe to
read from other threads.

A second mDNS service announcing a fingerprint that an online record already holds (a rogue
copying a paired device's public fingerprint, with its own host and port) never replaces that
record: it is kept aside as an *alternate*, and takes the record's place only if the record's own
service departs. So a rogue that announces first can hide the device until it withdraws, and
one that announces second changes nothing; either way, once the fake is withdrawn the real
device is back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from protocols.profile import Announcement


@dataclass(frozen=True)
class DeviceRecord:
    """One announcing device as last seen."""

    announcement: Announcement
    host: str
    service_name: str
    first_seen: float
    last_seen: float
    online: bool = True
    impostor_of: str | None = None
    """Fingerprint of the device that owned this name first, if this one claims it too."""

    @property
    def name(self) -> str:
        """The advertised device name."""
        return self.announcement.profile.name

    @property
    def fingerprint(self) -> str:
        """The certificate fingerprint the device announces (its identity here)."""
        return self.announcement.profile.cert_fingerprint


class DeviceRegistry:
    """Devices by fingerprint, updated by announcements and departures."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        paired_fingerprint: Callable[[str], str | None] | None = None,
    ) -> None:
        """``paired_fingerprint(name)``: the certificate ``name`` is paired with, if any."""
        self._clock = clock
        self._paired_fingerprint = paired_fingerprint
        self._lock = threading.Lock()
        self._devices: dict[str, DeviceRecord] = {}
        self._alternates: dict[str, dict[str, tuple[Announcement, str]]] = {}
        """Fingerprint -> service name -> (announcement, host) of other services announcing
        a fingerprint an online record holds."""
        self._changed = threading.Condition(self._lock)

    def announce(self, announcement: Announcement, host: str, service_name: str) -> DeviceRecord:
        """Record an announcement (a join or an update) and return the device's record."""
        fingerprint = announcement.profile.cert_fingerprint
        now = self._clock()
        with self._lock:
            previous = self._devices.get(fingerprint)
            if previous is not None and previous.online and previous.service_name != service_name:
                self._alternates.setdefault(fingerprint, {})[service_name] = (announcement, host)
                return self._flagged(previous)
            self._forget_replaced(service_name, fingerprint)
            owner = self._name_owner(announcement.profile.name, exclude=fingerprint)
            record = DeviceRecord(
                announcement=announcement,
                host=host,
                service_name=service_name,
                first_seen=previous.first_seen if previous else now,
                last_seen=now,
                impostor_of=owner.fingerprint if owner else None,
            )
            self._devices[fingerprint] = record
            self._changed.notify_all()
            return self._flagged(record)

    def depart(self, service_name: str) -> None:
        """Mark the device announced under ``service_name`` as gone."""
        with self._lock:
            for alternates in self._alternates.values():
                alternates.pop(service_name, None)
            for fingerprint, record in self._devices.items():
                if record.service_name == service_name and record.online:
                    self._devices[fingerprint] = self._successor(record)
            self._changed.notify_all()

    def _successor(self, record: DeviceRecord) -> DeviceRecord:
        """What replaces a departed record: an alternate announcing its fingerprint (online),
        or the record itself, offline."""
        alternates = self._alternates.get(record.fingerprint)
        if not alternates:
            return replace(record, online=False)
        service_name, (announcement, host) = alternates.popitem()
        return replace(
            record,
            announcement=announcement,
            host=host,
            service_name=service_name,
            last_seen=self._clock(),
            online=True,
        )

    def devices(self, online_only: bool = True) -> list[DeviceRecord]:
        """Every known device, in first-seen order."""
        with self._lock:
            records = sorted(self._devices.values(), key=lambda r: r.first_seen)
        return [self._flagged(r) for r in records if r.online or not online_only]

    def get(self, fingerprint: str) -> DeviceRecord | None:
        """The record of one device, online or not."""
        with self._lock:
            record = self._devices.get(fingerprint)
        return None if record is None else self._flagged(record)

    def wait_for(self, predicate: Callable[[list[DeviceRecord]], bool], timeout: float) -> bool:
        """Block until ``predicate(devices())`` holds or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                online = sorted(
                    (self._flagged(r) for r in self._devices.values() if r.online),
                    key=lambda r: r.first_seen,
                )
                if predicate(online):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)

    def _forget_replaced(self, service_name: str, fingerprint: str) -> None:
        """Settle a record whose mDNS service now announces another certificate.

        An agent that pairs re-announces under the same service instance with its new
        certificate, so an *unpaired* record replaced that way is dropped. A record that
        announced itself paired is only marked offline: anyone can announce any instance name
        (a rogue skips mDNS conflict probing), and a paired device must not vanish from the
        operator's view because another key took over its instance name.
        """
        for fp, record in list(self._devices.items()):
            if fp == fingerprint or record.service_name != service_name:
                continue
            if record.announcement.state.paired:
                self._devices[fp] = replace(record, online=False)
            else:
                del self._devices[fp]

    def _flagged(self, record: DeviceRecord) -> DeviceRecord:
        """``record`` with ``impostor_of`` set from the pairing book when its name is paired."""
        if self._paired_fingerprint is None:
            return record
        owner = self._paired_fingerprint(record.name)
        if owner is None:
            return record
        impostor_of = None if owner == record.fingerprint else owner
        return (
            record
            if impostor_of == record.impostor_of
            else replace(record, impostor_of=impostor_of)
        )

    def _name_owner(self, name: str, exclude: str) -> DeviceRecord | None:
        owners = [
            r
            for fp, r in self._devices.items()
            if fp != exclude and r.name == name and r.impostor_of is None
        ]
        return min(owners, key=lambda r: r.first_seen) if owners else None
