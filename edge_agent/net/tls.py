"""TLS 1.3 contexts with client certificates, and the check of a peer's name and role."""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Collection
from dataclasses import dataclass

from edge_agent.errors import PeerRejectedError
from edge_agent.trust.identity import Identity
from protocols.deploy import ROLE_AGENT


@dataclass(frozen=True)
class Peer:
    """A TLS peer as its verified certificate names it."""

    name: str
    role: str
    fingerprint: str = ""
    """SHA-256 of the certificate (DER), hex; empty for plain-TCP test peers."""


def server_context(identity: Identity) -> ssl.SSLContext:
    """Server side: TLS 1.3 only, a client certificate from the CA is required."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _common(ctx, identity)
    return ctx


def control_context(identity: Identity, scrapers: bool) -> ssl.SSLContext:
    """The control plane's server side: :func:`server_context`, except that with ``scrapers``
    (``fedshard agent --metrics-token-file``) a client certificate is optional, so that a
    scraper with the token but without a certificate completes the handshake. A certificate
    that is presented is still verified against the CA; a caller without one has no role and
    reaches only the routes its token opens."""
    ctx = server_context(identity)
    if scrapers:
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(identity: Identity) -> ssl.SSLContext:
    """Client side: TLS 1.3 only, presents our certificate, verifies the server's against the CA.

    Host names are not checked by OpenSSL (agents are reached by address); the caller checks the
    device name in the certificate with :func:`check_peer` instead.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    _common(ctx, identity)
    return ctx


def _common(ctx: ssl.SSLContext, identity: Identity) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    ctx.load_verify_locations(cafile=str(identity.ca_path))


def peer_of(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> Peer:
    """Name and role from the peer's verified certificate (``CN`` and ``OU``)."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    if not cert:
        raise PeerRejectedError("the peer presented no verified certificate")
    fields: dict[str, str] = {}
    subject: tuple[tuple[tuple[str, str], ...], ...] = cert.get("subject", ())  # type: ignore[assignment]
    for rdn in subject:
        for key, value in rdn:
            fields.setdefault(key, value)
    name = fields.get("commonName")
    if not name:
        raise PeerRejectedError("the peer's certificate has no common name")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    fingerprint = hashlib.sha256(der).hexdigest() if der else ""
    return Peer(name=name, role=fields.get("organizationalUnitName", ""), fingerprint=fingerprint)


def check_peer(
    peer: Peer, *, name: str | None = None, roles: Collection[str] | None = None
) -> Peer:
    """Raise PeerRejectedError unless the peer has the expected device name and one of ``roles``."""
    if name is not None and peer.name != name:
        raise PeerRejectedError(f"expected device {name!r}, the certificate says {peer.name!r}")
    if roles is not None and peer.role not in roles:
        raise PeerRejectedError(f"peer {peer.name!r} has role {peer.role!r}, not {sorted(roles)}")
    return peer


class Revocation:
    """The devices this agent refuses on every channel (set by the coordinator, persisted).

    Names are device names, so they revoke agent-role certificates only: a revoked name never
    matches the coordinator's own certificate, whatever name a rogue announced. Fingerprints
    revoke exactly one certificate, whatever its role.
    """

    def __init__(self, names: Collection[str] = (), fingerprints: Collection[str] = ()) -> None:
        self.names = frozenset(names)
        self.fingerprints = frozenset(fingerprints)

    def replace(self, names: Collection[str], fingerprints: Collection[str]) -> None:
        """Install a new complete list."""
        self.names = frozenset(names)
        self.fingerprints = frozenset(fingerprints)

    def revoked(self, peer: Peer) -> bool:
        """Whether ``peer`` is on the list."""
        return (peer.role == ROLE_AGENT and peer.name in self.names) or bool(
            peer.fingerprint and peer.fingerprint in self.fingerprints
        )

    def admit(self, peer: Peer) -> Peer:
        """Return ``peer``, or raise PeerRejectedError when it is revoked."""
        if self.revoked(peer):
            raise PeerRejectedError(f"device {peer.name!r} is revoked")
        return peer
