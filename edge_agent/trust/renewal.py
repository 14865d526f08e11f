"""Certificate renewal, agent side: the coordinator replaces a certificate before it expires.

The new certificate is accepted only if it certifies this agent's own key with its name and the
agent role, and was issued by the CA the agent is paired with; it is written next to the old one
(atomically) and used for every new connection, so a renewal changes nothing but the validity.
"""

from __future__ import annotations

import os

from cryptography import x509

from edge_agent.errors import PairingError
from edge_agent.trust.identity import Identity
from edge_agent.trust.pairing import check_agent_certificate
from protocols.deploy import CertificateRenewal


def accept_renewal(identity: Identity, renewal: CertificateRenewal) -> None:
    """Check a renewed certificate against this agent and its CA, then store it."""
    if not identity.paired:
        raise PairingError("this agent is not paired: nothing to renew")
    try:
        cert = x509.load_pem_x509_certificate(renewal.cert_pem.encode())
        ca = x509.load_pem_x509_certificate(identity.ca_path.read_bytes())
    except ValueError as exc:
        raise PairingError(f"the renewed certificate is not PEM: {exc}") from exc
    check_agent_certificate(identity, cert, ca, "the renewed certificate", "this agent's CA")
    tmp = identity.cert_path.with_suffix(".renew.tmp")
    tmp.write_text(renewal.cert_pem)
    os.replace(tmp, identity.cert_path)
