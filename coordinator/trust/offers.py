"""Pending pairing offers (``fedshard.pairing/2``), kept in memory and matched by code.

Several offers may carry one device name (a rogue can announce any name); each is kept under
its own key, so a same-name rogue can never replace a real device's request. An approval picks
the one offer whose commitment matches the code the operator typed (the code the real device
shows); the others stay out. The table is bounded per name and overall, and a full table refuses
*new* offers instead of evicting recorded ones: a flood of fake offers cannot push a real
request out. Offers are not persisted (the agents offer again after a restart), so no offer ever
rewrites ``pairings.json``.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from coordinator.errors import PairingError
from protocols.base import FrozenModel
from protocols.deploy import RESERVED_NAMES
from protocols.pairing import commitment, pairing_key

MAX_PER_NAME = 8
MAX_OFFERS = 1024


class PendingRequest(FrozenModel):
    """A certificate request waiting for the operator."""

    name: str
    code: str | None = None
    """Always None for ``fedshard.pairing/2`` offers: the code is shown on the device only."""
    csr_pem: str
    requested_at: float
    node_public_key: str | None = None
    """The agent's Flower node-authentication key (OpenSSH), if it sent one."""
    commitment: str | None = None
    key_id: str | None = None
    """First 16 hex digits of the SHA-256 of the offered public key (tells same-name offers
    apart)."""


class OfferTableFullError(PairingError):
    """No room for another pending offer (for this name, or at all); recorded ones stay."""


def public_key_der(csr_pem: str) -> bytes:
    """The SubjectPublicKeyInfo DER of a signed PEM certificate request; raises PairingError."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except ValueError as exc:
        raise PairingError(f"not a PEM certificate request: {exc}") from exc
    if not csr.is_signature_valid:
        raise PairingError("the certificate request is not signed by its own key")
    return csr.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def check_name(name: str) -> None:
    """Refuse names reserved for the coordinator's own certificates."""
    if name.lower() in RESERVED_NAMES:
        raise PairingError(f"device name {name!r} is reserved for the coordinator")


class PendingOffers:
    """Offers by (name, key id); bounded, never evicting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[tuple[str, str], PendingRequest] = {}

    def add(
        self,
        name: str,
        csr_pem: str,
        node_public_key: str | None,
        offer_commitment: str | None,
    ) -> PendingRequest:
        """Record (or refresh) an offer; raises PairingError for unusable ones."""
        check_name(name)
        if offer_commitment is None:
            raise PairingError(
                f"{name!r} offered no code commitment (fedshard.pairing/1 agent): upgrade it"
            )
        key_id = hashlib.sha256(public_key_der(csr_pem)).hexdigest()[:16]
        entry = PendingRequest(
            name=name,
            csr_pem=csr_pem,
            requested_at=time.time(),
            node_public_key=node_public_key,
            commitment=offer_commitment,
            key_id=key_id,
        )
        with self._lock:
            if (name, key_id) not in self._offers:
                same_name = sum(1 for n, _ in self._offers if n == name)
                if same_name >= MAX_PER_NAME or len(self._offers) >= MAX_OFFERS:
                    raise OfferTableFullError(
                        f"no room for another pairing offer from {name!r}; recorded ones kept"
                    )
            self._offers[(name, key_id)] = entry
        return entry

    def for_name(self, name: str) -> list[PendingRequest]:
        """The offers carrying ``name``."""
        with self._lock:
            return [p for (n, _), p in self._offers.items() if n == name]

    def all(self) -> list[PendingRequest]:
        """Every pending offer, oldest first."""
        with self._lock:
            return sorted(self._offers.values(), key=lambda p: p.requested_at)

    def drop(self, name: str) -> None:
        """Forget every offer carrying ``name`` (it was approved or revoked)."""
        with self._lock:
            for key in [k for k in self._offers if k[0] == name]:
                del self._offers[key]

    def discard(self, name: str, key_id: str) -> None:
        """Forget one offer (its device stopped announcing)."""
        with self._lock:
            self._offers.pop((name, key_id), None)


def match(offers: list[PendingRequest], code: str) -> tuple[PendingRequest, bytes] | None:
    """The offer whose commitment the typed code opens, and the grant key; None if none."""
    for offer in offers:
        if offer.commitment is None:
            continue
        key = pairing_key(code, public_key_der(offer.csr_pem))
        if hmac.compare_digest(commitment(key).encode(), offer.commitment.encode()):
            return offer, key
    return None
