"""TLS to the agents: the client context both planes use, and the peer-certificate check.

:func:`client_context` presents the coordinator's certificate (:class:`CoordinatorIdentity`, made
by :func:`coordinator.trust.identity.open_identity`) and trusts only the CA; the peer's device
name and role are checked by the caller against the certificate (:func:`check_peer`), never by
host name. :func:`pairing_context` reaches an unpaired agent, whose certificate cannot be verified.
"""

from __future__ import annotations

import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from coordinator.errors import AgentError


@dataclass(frozen=True)
class CoordinatorIdentity:
    """Paths of the coordinator's key, certificate and the CA certificate."""

    key_path: Path
    cert_path: Path
    ca_path: Path


@dataclass(frozen=True)
class PeerIdentity:
    """A TLS peer as its verified certificate names it."""

    name: str
    role: str
    fingerprint: str


def client_context(identity: CoordinatorIdentity) -> ssl.SSLContext:
    """TLS 1.3, our certificate presented, the server's verified against the CA only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # agents are reached by address; the CN is checked instead
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    ctx.load_verify_locations(cafile=str(identity.ca_path))
    return ctx


def pairing_context() -> ssl.SSLContext:
    """TLS 1.3 to an unpaired agent: its self-signed certificate cannot be verified.

    Trust in the pairing flow comes from the operator comparing codes, not from TLS.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_identity(sock: ssl.SSLSocket | ssl.SSLObject) -> PeerIdentity:
    """Name (CN), role (OU) and fingerprint of the verified peer certificate."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise AgentError("the peer presented no certificate")
    cert = x509.load_der_x509_certificate(der)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return PeerIdentity(
        name=str(names[0].value) if names else "",
        role=str(roles[0].value) if roles else "",
        fingerprint=hashlib.sha256(der).hexdigest(),
    )


def check_peer(sock: ssl.SSLSocket | ssl.SSLObject, device: str, role: str) -> PeerIdentity:
    """Raise AgentError unless the peer's certificate names ``device`` with ``role``."""
    peer = peer_identity(sock)
    if peer.name != device or peer.role != role:
        raise AgentError(
            f"expected {role} {device!r}, the certificate names {peer.role} {peer.name!r}"
        )
    return peer
