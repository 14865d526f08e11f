"""Certificate renewal, agent side: the coordinator replaces a certificate before it expires.

The new certificate is accepted only if it certifies this agent's own key with its name and the
agent role, and was issued by the CA the agent is paired with; it is written next to the old one
(atomically) and used for every new connection, so a renewal changes nothing but the validity.
"""

from __future__ import annotations

import os

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from edge_agent.errors import PairingError
from edge_agent.identity import Identity, load_private_key, spki
from protocols.deploy import ROLE_AGENT, CertificateRenewal


def accept_renewal(identity: Identity, renewal: CertificateRenewal) -> None:
    """Check a renewed certificate against this agent and its CA, then store it."""
    if not identity.paired:
        raise PairingError("this agent is not paired: nothing to renew")
    try:
        cert = x509.load_pem_x509_certificate(renewal.cert_pem.encode())
        ca = x509.load_pem_x509_certificate(identity.ca_path.read_bytes())
    except ValueError as exc:
        raise PairingError(f"the renewed certificate is not PEM: {exc}") from exc
    key = load_private_key(identity.key_path.read_bytes())
    if spki(cert.public_key()) != spki(key.public_key()):
        raise PairingError("the renewed certificate is for another key")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if not names or names[0].value != identity.name or not roles or roles[0].value != ROLE_AGENT:
        raise PairingError(f"the renewed certificate does not name agent {identity.name!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PairingError("the renewed certificate was not issued by this agent's CA") from exc
    tmp = identity.cert_path.with_suffix(".renew.tmp")
    tmp.write_text(renewal.cert_pem)
    os.replace(tmp, identity.cert_path)
