"""The coordinator's own TLS identity: a ``coordinator``-role certificate from its CA.

Created next to the CA on first start (key mode 0600); :mod:`coordinator.transport.tls` presents
it to the agents on both planes.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.errors import StateError
from coordinator.transport.tls import CoordinatorIdentity
from coordinator.trust.ca import CA_CERT_FILE, CertificateAuthority
from coordinator.trust.renewal import RENEW_BEFORE
from hostkit.files import write_atomic
from protocols.deploy import ROLE_COORDINATOR

KEY_FILE = "coordinator_key.pem"
CERT_FILE = "coordinator_cert.pem"
COORDINATOR_NAME = "coordinator"


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
    :data:`coordinator.trust.renewal.RENEW_BEFORE`; whether it did."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > RENEW_BEFORE:
        return False
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StateError(f"{key_path} does not hold the coordinator's EC key")
    write_atomic(
        cert_path, ca.issue_for_key(key.public_key(), COORDINATOR_NAME, ROLE_COORDINATOR).pem
    )
    return True
