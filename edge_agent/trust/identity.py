"""The agent's identity: its key pair, its certificate from the coordinator's CA, and the CA.

Before pairing the agent has only a key pair (kept in the state dir, mode 0600) and a
self-signed certificate; it advertises itself as unpaired and every handshake is refused. After
pairing it is given the CA certificate and its own certificate (``CN`` = device name,
``OU`` = role, see :mod:`protocols.deploy`); the CA's public key also verifies deploy signatures.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

from edge_agent.config import AgentConfig
from edge_agent.errors import ConfigError, SignatureError
from protocols.deploy import ROLE_AGENT

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

KEY_FILE = "agent_key.pem"
SELF_SIGNED_FILE = "self_signed.pem"


@dataclass(frozen=True)
class Identity:
    """Who this agent is and whom it trusts; the PEM paths feed the TLS contexts."""

    name: str
    device_id: str
    cert_fingerprint: str
    paired: bool
    cert_path: Path
    key_path: Path
    ca_path: Path
    ca_public_key: PublicKey | None


def device_id_of(public_key: PublicKey) -> str:
    """Stable device id: the first 32 hex digits of SHA-256 over the public key (SPKI DER)."""
    return hashlib.sha256(spki(public_key)).hexdigest()[:32]


def cert_fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER encoding, hex."""
    return cert.fingerprint(hashes.SHA256()).hex()


def load_identity(config: AgentConfig) -> Identity:
    """Load (or, unpaired, create) the agent's identity; raises ConfigError on any mismatch."""
    if config.tls is None:
        return _unpaired_identity(config)
    try:
        key = load_private_key(config.tls.key.read_bytes())
        cert = x509.load_pem_x509_certificate(config.tls.cert.read_bytes())
        ca = x509.load_pem_x509_certificate(config.tls.ca.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the TLS files: {exc}") from exc
    if spki(cert.public_key()) != spki(key.public_key()):
        raise ConfigError(f"{config.tls.cert} does not belong to the key {config.tls.key}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise ConfigError(f"{config.tls.cert} was not issued by {config.tls.ca}") from exc
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names or names[0].value != config.name:
        raise ConfigError(f"{config.tls.cert} is not issued to device {config.name!r}")
    ca_key = ca.public_key()
    if not isinstance(ca_key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
        raise ConfigError("the CA key must be EC P-256 or Ed25519")
    return Identity(
        name=config.name,
        device_id=device_id_of(_public(key)),
        cert_fingerprint=cert_fingerprint(cert),
        paired=True,
        cert_path=config.tls.cert,
        key_path=config.tls.key,
        ca_path=config.tls.ca,
        ca_public_key=ca_key,
    )


def verify_signature(
    public_key: PublicKey | None, algorithm: str, signature: bytes, data: bytes
) -> None:
    """Check the coordinator's signature over ``data``; raises SignatureError."""
    if public_key is None:
        raise SignatureError("this agent is not paired: it has no CA key to verify with")
    try:
        if algorithm == "ed25519" and isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, data)
        elif algorithm == "ecdsa-p256-sha256" and isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            raise SignatureError(f"signature algorithm {algorithm!r} does not match the CA key")
    except InvalidSignature:
        raise SignatureError("the deploy manifest's signature does not verify") from None


def _unpaired_identity(config: AgentConfig) -> Identity:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    key_path = config.state_dir / KEY_FILE
    if key_path.exists():
        key = load_private_key(key_path.read_bytes())
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
    cert_path = config.state_dir / SELF_SIGNED_FILE
    cert_path.write_bytes(_self_signed(key, config.name).public_bytes(serialization.Encoding.PEM))
    return Identity(
        name=config.name,
        device_id=device_id_of(_public(key)),
        cert_fingerprint=hashlib.sha256(spki(_public(key))).hexdigest(),
        paired=False,
        cert_path=cert_path,
        key_path=key_path,
        ca_path=cert_path,
        ca_public_key=None,
    )


def _self_signed(key: PrivateKey, name: str) -> x509.Certificate:
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLE_AGENT),
        ]
    )
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(_public(key))
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
    )
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm)


def load_private_key(pem: bytes) -> PrivateKey:
    """An EC or Ed25519 private key from unencrypted PEM; raises ConfigError otherwise."""
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
        raise ConfigError("the agent key must be EC or Ed25519")
    return key


def _public(key: PrivateKey) -> PublicKey:
    return key.public_key()


def spki(public_key: object) -> bytes:
    """SubjectPublicKeyInfo DER of an EC or Ed25519 public key."""
    if not isinstance(public_key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
        raise ConfigError("unsupported public key type")
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
