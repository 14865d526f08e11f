"""Pairing: agents ask for a certificate, the operator approves by code, revoked ones stay out.

An agent sends a certificate request and a commitment to the code it shows; the coordinator
keeps it as *pending*, in memory (:mod:`coordinator.trust.offers`). The operator approves
``NAME CODE`` with the code the device shows; only the offer whose commitment that code opens
is approved, a wrong code is refused, and wrong codes are rate-limited (see
:class:`AttemptLimits`): too many for one device, or for all devices together, within a window
lock approvals for a while, even with the right code. Approval issues a certificate from the CA.
Revocation is by certificate fingerprint and by device name, and is permanent. The book is
persisted atomically in the state dir, so pairings survive a restart.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from pydantic import Field

from coordinator.errors import (
    PairingError,
    RevokedError,
    StateError,
    TooManyAttemptsError,
    WrongCodeError,
)
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.offers import PendingOffers, PendingRequest, match
from hostkit.files import write_atomic
from protocols.base import FrozenModel
from protocols.deploy import ROLE_AGENT
from protocols.errors import SchemaError

BOOK_FILE = "pairings.json"
__all__ = ["AttemptLimits", "PairedDevice", "Pairing", "PairingBook", "PendingRequest"]


class PairedDevice(FrozenModel):
    """A device the CA certified."""

    name: str
    fingerprint: str
    cert_pem: str
    paired_at: float
    node_public_key: str | None = None
    """Registered with the SuperLink of every training run (see :meth:`Pairing.node_keys`)."""
    previous_fingerprint: str | None = None
    """The certificate this one renewed, trusted until the agent announces the new one."""


class PairingBook(FrozenModel):
    """The ``pairings.json`` file."""

    pending: list[PendingRequest] = Field(default_factory=list)
    paired: list[PairedDevice] = Field(default_factory=list)
    revoked_fingerprints: list[str] = Field(default_factory=list)
    revoked_names: list[str] = Field(default_factory=list)


@dataclass(frozen=True)
class AttemptLimits:
    """How many failed approvals are tolerated before approvals are locked.

    A failure is a wrong code (counted for the device and overall) or an approval for a name
    with no pending request (counted overall). ``per_device`` failures for one name within
    ``window_s`` lock that name, and ``overall`` failures within ``window_s`` lock every name,
    for ``lockout_s`` seconds. With 40-bit codes this keeps guessing hopeless.
    """

    per_device: int = 5
    overall: int = 20
    window_s: float = 300.0
    lockout_s: float = 300.0


class AttemptLimiter:
    """Sliding-window failure counts per device name and overall, and the locks they cause."""

    OVERALL = ""
    """Key of the overall count (device names are never empty)."""

    def __init__(self, limits: AttemptLimits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._locked_until: dict[str, float] = {}

    def check(self, name: str) -> None:
        """Raise TooManyAttemptsError while ``name``, or every name, is locked."""
        now = self._clock()
        for key in (self.OVERALL, name):
            until = self._locked_until.get(key, 0.0)
            if until > now:
                whom = "all devices" if key == self.OVERALL else f"device {name!r}"
                wait = math.ceil(until - now)
                raise TooManyAttemptsError(
                    f"too many wrong pairing codes for {whom}: try again in {wait} s", until - now
                )

    def failed(self, name: str | None) -> None:
        """Count a failure for ``name`` (None: overall only) and lock what went over."""
        now = self._clock()
        self._count(self.OVERALL, now, self._limits.overall)
        if name is not None:
            self._count(name, now, self._limits.per_device)

    def succeeded(self, name: str) -> None:
        """Forget ``name``'s failures (the overall count stays)."""
        self._failures.pop(name, None)
        self._locked_until.pop(name, None)

    def _count(self, key: str, now: float, limit: int) -> None:
        times = self._failures.setdefault(key, deque())
        times.append(now)
        while times and times[0] <= now - self._limits.window_s:
            times.popleft()
        if len(times) >= limit:
            self._locked_until[key] = now + self._limits.lockout_s
            times.clear()


class Pairing:
    """Pending requests, approvals and revocations, backed by the state dir."""

    def __init__(
        self,
        state_dir: Path,
        ca: CertificateAuthority,
        limits: AttemptLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = state_dir / BOOK_FILE
        self._ca = ca
        self._lock = threading.Lock()
        self._book = self._load().model_copy(update={"pending": []})
        self._pending = PendingOffers()
        self._attempts = AttemptLimiter(limits or AttemptLimits(), clock)

    def request(
        self,
        name: str,
        csr_pem: str,
        node_public_key: str | None = None,
        commitment: str | None = None,
    ) -> str:
        """Record an agent's offer (certificate request, code commitment, node key) as pending
        in memory; returns its key id. Raises PairingError (RevokedError, reserved names, a full
        table: see :mod:`coordinator.trust.offers`)."""
        with self._lock:
            if name in self._book.revoked_names:
                raise RevokedError(f"device {name!r} is revoked")
        return self._pending.add(name, csr_pem, node_public_key, commitment).key_id or ""

    def approve(self, name: str, code: str) -> PairedDevice:
        """Issue the certificate of the pending offer of ``name`` that ``code`` opens.

        Raises TooManyAttemptsError while approvals for ``name`` are locked (see
        :class:`AttemptLimits`), whatever the code.
        """
        return self.approve_with_key(name, code)[0]

    def approve_with_key(self, name: str, code: str) -> tuple[PairedDevice, bytes]:
        """:meth:`approve`, also returning the key the grant's proof is made with."""
        with self._lock:
            self._attempts.check(name)
            if name in self._book.revoked_names:
                raise RevokedError(f"device {name!r} is revoked")
            offers = self._pending.for_name(name)
            if not offers:
                # nothing to pair: not a guess, so not counted (an early ``fedshard pair``
                # retrying until the request arrives must not lock anyone out)
                raise PairingError(f"no pending pairing request from {name!r}")
            matched = match(offers, code)
            if matched is None:
                self._attempts.failed(name)
                raise WrongCodeError(f"the code does not match device {name!r}")
            request, key = matched
            self._attempts.succeeded(name)
            issued = self._ca.issue(request.csr_pem.encode(), name=name, role=ROLE_AGENT)
            device = PairedDevice(
                name=name,
                fingerprint=issued.fingerprint,
                cert_pem=issued.pem.decode(),
                paired_at=time.time(),
                node_public_key=request.node_public_key,
            )
            book = self._book
            self._save(
                book.model_copy(
                    update={"paired": [*(d for d in book.paired if d.name != name), device]}
                )
            )
            self._pending.drop(name)
        return device, key

    def revoke(self, name: str) -> None:
        """Refuse ``name`` and every certificate it was given, from now on."""
        with self._lock:
            book = self._book
            if name not in {d.name for d in book.paired} and not self._pending.for_name(name):
                raise PairingError(f"unknown device {name!r}")
            fingerprints = [d.fingerprint for d in book.paired if d.name == name]
            fingerprints += [
                d.previous_fingerprint
                for d in book.paired
                if d.name == name and d.previous_fingerprint is not None
            ]
            self._save(
                book.model_copy(
                    update={
                        "paired": [d for d in book.paired if d.name != name],
                        "revoked_fingerprints": sorted({*book.revoked_fingerprints, *fingerprints}),
                        "revoked_names": sorted({*book.revoked_names, name}),
                    }
                )
            )
            self._pending.drop(name)

    def renew(self, name: str) -> PairedDevice:
        """Issue ``name`` a new certificate for the same key, name and role.

        See :mod:`coordinator.trust.renewal`; the old one stays trusted until the agent uses the
        new one.
        """
        with self._lock:
            device = next((d for d in self._book.paired if d.name == name), None)
            if device is None:
                raise PairingError(f"device {name!r} is not paired")
            public_key = x509.load_pem_x509_certificate(device.cert_pem.encode()).public_key()
            issued = self._ca.issue_for_key(public_key, name, ROLE_AGENT)
            renewed = device.model_copy(
                update={
                    "fingerprint": issued.fingerprint,
                    "cert_pem": issued.pem.decode(),
                    "previous_fingerprint": device.fingerprint,
                }
            )
            book = self._book
            paired = [renewed if d.name == name else d for d in book.paired]
            self._save(book.model_copy(update={"paired": paired}))
        return renewed

    def discard_offer(self, name: str, key_id: str) -> None:
        """Forget one pending offer (its device no longer announces that key)."""
        self._pending.discard(name, key_id)

    def book(self) -> PairingBook:
        """A snapshot of every pending, paired and revoked device."""
        with self._lock:
            return self._book.model_copy(update={"pending": self._pending.all()})

    def fingerprint_of(self, name: str) -> str | None:
        """The certificate fingerprint ``name`` is paired with (None if unpaired or revoked)."""
        with self._lock:
            return next((d.fingerprint for d in self._book.paired if d.name == name), None)

    def node_keys(self) -> dict[str, str]:
        """Node-authentication keys of the paired (not revoked) devices that sent one, by name."""
        with self._lock:
            return {d.name: d.node_public_key for d in self._book.paired if d.node_public_key}

    def is_trusted(self, name: str, fingerprint: str) -> bool:
        """Whether ``name`` is paired with exactly this certificate and not revoked."""
        with self._lock:
            if fingerprint in self._book.revoked_fingerprints:
                return False
            return any(
                d.name == name and fingerprint in (d.fingerprint, d.previous_fingerprint)
                for d in self._book.paired
            )

    def _load(self) -> PairingBook:
        if not self._path.exists():
            return PairingBook()
        try:
            return PairingBook.from_json(self._path.read_bytes())
        except (OSError, SchemaError) as exc:
            raise StateError(f"cannot read {self._path}: {exc}") from exc

    def _save(self, book: PairingBook) -> None:
        write_atomic(self._path, book.to_json().encode(), mode=0o600)
        self._book = book
