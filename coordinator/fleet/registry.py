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

A service announcing another key under a *paired* device's own mDNS instance name (a rogue skips
mDNS conflict probing) contests that name: the paired record, the pairing book's certificate for
its name, stays online at the address it had before the conflict (``contested_by`` names the
other key), so the authenticated liveness pings keep deciding whether it is used, and nothing
fails over while the device answers. mDNS cannot tell whose goodbye ends the conflict (both
announce the same pointer record), so a departure of a contested name leaves the paired record
online but *unconfirmed*: discovery asks for the name again, the device's answer confirms it, and
:meth:`DeviceRegistry.expire` takes it offline if no answer came within
:attr:`~coordinator.config.Timeouts.mdns_confirm_s`.

Records of fingerprints the pairing book does not hold are bounded: at most
:data:`MAX_UNPAIRED` at a time (a full table forgets the longest-silent offline one, and refuses
new ones when all are online, never evicting a paired record), and an offline one is forgotten
:attr:`~coordinator.config.Timeouts.unpaired_forget_s` after it was last seen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from coordinator.config import Timeouts
from protocols.profile import Announcement

log = logging.getLogger(__name__)
MAX_UNPAIRED = 256
"""Records of fingerprints the pairing book does not hold, online and offline together."""


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
    contested_by: str | None = None
    """Fingerprint of another key announcing this paired device's own instance name."""
    confirm_by: float | None = None
    """Set after a contested departure: offline at this time unless the device answers again."""

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
        timeouts: Timeouts | None = None,
    ) -> None:
        """``paired_fingerprint(name)``: the certificate ``name`` is paired with, if any."""
        self._clock = clock
        self._timeouts = timeouts or Timeouts()
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
            if previous is not None and previous.online and previous.contested_by is not None:
                # the paired device's own name is contested: its address stays the one it had
                record = replace(previous, last_seen=now, confirm_by=None)
                self._devices[fingerprint] = record
                return self._flagged(record)
            if previous is None and not self._room_for(announcement):
                log.warning("registry full: %s not listed", announcement.profile.name)
                return DeviceRecord(announcement, host, service_name, now, now, online=False)
            self._settle_holders(service_name, announcement)
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

    def depart(self, service_name: str) -> bool:
        """Mark the device announced under ``service_name`` as gone.

        Returns whether a paired record of a contested name stayed online, unconfirmed: the
        caller should ask for the name again (see the module docstring).
        """
        kept = False
        with self._lock:
            for alternates in self._alternates.values():
                alternates.pop(service_name, None)
            for fingerprint, record in self._devices.items():
                if record.service_name != service_name or not record.online:
                    continue
                if record.contested_by is not None:
                    confirm_by = self._clock() + self._timeouts.mdns_confirm_s
                    self._devices[fingerprint] = replace(
                        record, contested_by=None, confirm_by=confirm_by
                    )
                    kept = True
                else:
                    self._devices[fingerprint] = self._successor(record)
            self._changed.notify_all()
        return kept

    def unconfirmed(self) -> list[str]:
        """Service names of paired records waiting for their device to answer again."""
        with self._lock:
            return sorted(
                {r.service_name for r in self._devices.values() if r.confirm_by is not None}
            )

    def expire(self) -> None:
        """Take unconfirmed records past their deadline offline; forget old unpaired ones."""
        now = self._clock()
        with self._lock:
            for fingerprint, record in list(self._devices.items()):
                if record.confirm_by is not None and record.confirm_by <= now:
                    self._devices[fingerprint] = replace(record, online=False, confirm_by=None)
                elif (
                    not record.online
                    and not self._in_book(record)
                    and now - record.last_seen >= self._timeouts.unpaired_forget_s
                ):
                    del self._devices[fingerprint]
                    self._alternates.pop(fingerprint, None)
            self._changed.notify_all()

    def _successor(self, record: DeviceRecord) -> DeviceRecord:
        """What replaces a departed record: an alternate announcing its fingerprint (online),
        or the record itself, offline."""
        alternates = self._alternates.get(record.fingerprint)
        if not alternates:
            return replace(record, online=False, confirm_by=None)
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

    def _settle_holders(self, service_name: str, announcement: Announcement) -> None:
        """Settle the records of another key that ``service_name`` announced until now.

        The pairing book's record for its name is *contested*, never replaced: it stays online
        (see the module docstring), unless the newcomer is the book's certificate for that
        name (an agent re-announcing its renewed certificate). An agent that pairs
        re-announces under the same service instance with its new certificate, so an
        *unpaired* record replaced that way is dropped. Any other record that announced itself
        paired is marked offline.
        """
        fingerprint = announcement.profile.cert_fingerprint
        for fp, record in list(self._devices.items()):
            if fp == fingerprint or record.service_name != service_name:
                continue
            if record.online and self._in_book(record) and not self._succeeds(record, fingerprint):
                self._devices[fp] = replace(record, contested_by=fingerprint, confirm_by=None)
                log.warning(
                    "%s: key %s announces the instance name of paired %s; keeping %s",
                    service_name,
                    fingerprint[:16],
                    record.name,
                    fp[:16],
                )
            elif record.announcement.state.paired:
                self._devices[fp] = replace(record, online=False, confirm_by=None)
            else:
                del self._devices[fp]

    def _in_book(self, record: DeviceRecord) -> bool:
        """Whether ``record``'s fingerprint is the pairing book's certificate for its name."""
        if self._paired_fingerprint is None:
            return False
        return self._paired_fingerprint(record.name) == record.fingerprint

    def _succeeds(self, record: DeviceRecord, fingerprint: str) -> bool:
        """Whether ``fingerprint`` is the book's certificate for ``record``'s name now."""
        assert self._paired_fingerprint is not None
        return self._paired_fingerprint(record.name) == fingerprint

    def _room_for(self, announcement: Announcement) -> bool:
        """Whether a new record fits: records the book does not hold are at most
        :data:`MAX_UNPAIRED`; the longest-silent offline one makes room, never an online one."""
        if self._paired_fingerprint is not None and (
            self._paired_fingerprint(announcement.profile.name)
            == announcement.profile.cert_fingerprint
        ):
            return True
        outside = [r for r in self._devices.values() if not self._in_book(r)]
        if len(outside) < MAX_UNPAIRED:
            return True
        offline = [r for r in outside if not r.online]
        if not offline:
            return False
        oldest = min(offline, key=lambda r: r.last_seen)
        del self._devices[oldest.fingerprint]
        self._alternates.pop(oldest.fingerprint, None)
        return True

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
