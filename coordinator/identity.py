"""The coordinator's own TLS identity: a ``coordinator``-role certificate from its CA.

Created next to the CA on first start (key mode 0600). :func:`client_context` presents it to
agents on both planes and trusts only the CA; the peer's device name is checked by the caller
against the certificate (:func:`peer_identity`), never by host name.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coordinator.ca import CA_CERT_FILE, CertificateAuthority
from coordinator.errors import AgentError
from coordinator.renewal import RENEW_BEFORE
from coordinator.state import write_atomic
from protocols.deploy import ROLE_COORDINATOR

KEY_FILE = "coordinator_key.pem"
CERT_FILE = "coordinator_cert.pem"
COORDINATOR_NAME = "coordinator"


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


def open_identity(state_dir: Path, ca: CertificateAuthority) -> CoordinatorIdentity:
    """The coordinator's certificate, issued by ``ca`` on first use."""
    key_path, cert_path = state_dir / KEY_FILE, state_dir / CERT_FILE
    if not (key_path.exists() and cert_path.exists()):
        key = ec.generate_private_key(ec.SECP256R1())
        issued = ca.issue_for_key(key.public_key(), COORDINATOR_NAME, ROLE_COORDINATOR)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_atomic(key_path, pem, mode=0o600)
        write_atomic(cert_path, issued.pem)
    else:
        renew_if_expiring(key_path, cert_path, ca)
    return CoordinatorIdentity(key_path, cert_path, state_dir / CA_CERT_FILE)


def renew_if_expiring(key_path: Path, cert_path: Path, ca: CertificateAuthority) -> bool:
    """Re-issue the coordinator's certificate for the same key when it expires within
    :data:`coordinator.renewal.RENEW_BEFORE`; whether it did."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > RENEW_BEFORE:
        return False
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    write_atomic(
        cert_path, ca.issue_for_key(key.public_key(), COORDINATOR_NAME, ROLE_COORDINATOR).pem
    )
    return True


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
