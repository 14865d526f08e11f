"""Pairing, agent side (protocols.pairing): show a code, hand out a CSR, accept a certificate.

An unpaired agent serves only ``GET /v1/pairing`` (its :class:`PairingOffer`: a certificate
request for its own key and the commitment to its code) and ``POST /v1/pairing`` (a
:class:`PairingGrant`), over TLS with its self-signed certificate and no client certificate.
The code is derived from a random secret kept in the state dir (``pairing-secret``, mode 0600)
and the agent's public key; the agent logs it and writes it to ``STATE_DIR/pairing-code`` (0600)
for the operator, and it never travels. The grant is accepted only if it proves knowledge of
the code (``protocols.pairing.grant_proof``), its certificate certifies this agent's own key,
names this device with the agent role, and was issued by the CA sent along; the files are then
written to the state dir, where later starts find them. A grant from anyone who did not get the
code from the operator (a foreign CA on the LAN) is refused and the agent stays unpaired.

The offer also carries the agent's Flower node-authentication public key (EC P-256, OpenSSH
format, made on first use under ``STATE_DIR/training/node-auth``); the coordinator registers it
with its SuperLink, and the agent's SuperNode signs in with the private half.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from edge_agent.config import TlsFiles
from edge_agent.errors import PairingError
from edge_agent.trust.identity import KEY_FILE, Identity, load_private_key, spki
from hostkit.files import write_atomic
from protocols.deploy import ROLE_AGENT
from protocols.pairing import (
    CODE_FILE,
    PairingGrant,
    PairingOffer,
    commitment,
    new_secret,
    pairing_key,
    proof_matches,
    secret_code,
)

CA_FILE = "ca.pem"
CERT_FILE = "cert.pem"
NODE_KEY_DIR = "node-auth"
SECRET_FILE = "pairing-secret"


def node_key_dir(state_dir: Path) -> Path:
    """Where an agent keeps its node-authentication key pair."""
    return state_dir / "training" / NODE_KEY_DIR


def make_node_key(directory: Path) -> tuple[Path, Path]:
    """Create a node-authentication key pair (EC P-256, OpenSSH format) in ``directory``.

    Returns (private key path, public key path); the public key is what the coordinator
    registers with its SuperLink. An existing pair is reused.
    """
    private, public = directory / "node_auth_key", directory / "node_auth_key.pub"
    if private.is_file() and public.is_file():
        return private, public
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    text = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    public.write_bytes(text + b"\n")
    return private, public


def node_public_key(state_dir: Path) -> str:
    """The agent's node-authentication public key (OpenSSH, one line), made on first use."""
    _, public = make_node_key(node_key_dir(state_dir))
    return public.read_text().strip()


def stored_tls(state_dir: Path) -> TlsFiles | None:
    """The certificate files an earlier pairing left in the state dir, if any."""
    files = TlsFiles(state_dir / CA_FILE, state_dir / CERT_FILE, state_dir / KEY_FILE)
    return files if all(p.exists() for p in (files.ca, files.cert, files.key)) else None


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def pairing_secret(state_dir: Path) -> bytes:
    """The agent's pairing secret, made on first use (mode 0600)."""
    path = state_dir / SECRET_FILE
    if path.is_file():
        secret = path.read_bytes()
        if len(secret) >= 16:
            return secret
    secret = new_secret()
    _write_private(path, secret)
    return secret


def shown_code(identity: Identity) -> str:
    """The code this unpaired agent shows its operator (also written to ``pairing-code``)."""
    public = spki(load_private_key(identity.key_path.read_bytes()).public_key())
    code = secret_code(pairing_secret(identity.key_path.parent), public)
    _write_private(identity.key_path.parent / CODE_FILE, f"{code}\n".encode())
    return code


def grant_key(identity: Identity) -> bytes:
    """The key a grant must prove knowledge of (see ``protocols.pairing.pairing_key``)."""
    public = spki(load_private_key(identity.key_path.read_bytes()).public_key())
    return pairing_key(shown_code(identity), public)


def pairing_offer(identity: Identity, key_for_grants: bytes | None = None) -> PairingOffer:
    """A certificate request for the agent's key (CN = name, OU = agent), the commitment to its
    code (from :func:`grant_key`) and its node-authentication public key (the key files sit
    next to the agent's key)."""
    key = load_private_key(identity.key_path.read_bytes())
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLE_AGENT),
        ]
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, algorithm)
    return PairingOffer(
        name=identity.name,
        csr_pem=csr.public_bytes(serialization.Encoding.PEM).decode(),
        commitment=commitment(grant_key(identity) if key_for_grants is None else key_for_grants),
        node_public_key=node_public_key(identity.key_path.parent),
    )


def accept_grant(
    identity: Identity, grant: PairingGrant, state_dir: Path, key_for_grants: bytes
) -> TlsFiles:
    """Check a grant's proof, and its certificate against this agent's key and name, store it;
    raises PairingError."""
    if identity.paired:
        raise PairingError("this agent is already paired")
    if not proof_matches(key_for_grants, grant):
        raise PairingError(
            "the grant does not prove knowledge of this agent's pairing code; refused"
        )
    try:
        ca = x509.load_pem_x509_certificate(grant.ca_pem.encode())
        cert = x509.load_pem_x509_certificate(grant.cert_pem.encode())
    except ValueError as exc:
        raise PairingError(f"the grant's certificates are not PEM: {exc}") from exc
    check_agent_certificate(identity, cert, ca, "the certificate", "the CA in the grant")
    files = TlsFiles(state_dir / CA_FILE, state_dir / CERT_FILE, state_dir / KEY_FILE)
    for path, text in ((files.ca, grant.ca_pem), (files.cert, grant.cert_pem)):
        write_atomic(path, text.encode())
    return files


def check_agent_certificate(
    identity: Identity, cert: x509.Certificate, ca: x509.Certificate, what: str, issuer: str
) -> None:
    """``cert`` must certify this agent's own key, with its name and the agent role, and be
    issued by ``ca``; PairingError (its message starting with ``what``) otherwise."""
    key = load_private_key(identity.key_path.read_bytes())
    if spki(cert.public_key()) != spki(key.public_key()):
        raise PairingError(f"{what} is for another key")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    if not names or names[0].value != identity.name or not roles or roles[0].value != ROLE_AGENT:
        raise PairingError(f"{what} does not name agent {identity.name!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise PairingError(f"{what} was not issued by {issuer}") from exc


def pairing_server_context(identity: Identity) -> ssl.SSLContext:
    """TLS 1.3 with the self-signed certificate, no client certificate: pairing routes only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(identity.cert_path, identity.key_path)
    return ctx
