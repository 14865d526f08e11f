"""The coordinator's certificate authority: it certifies paired devices and signs deployments.

Its key (EC P-256) lives in the state dir with mode 0600. Every certificate it issues carries
the device name as subject ``CN`` and the role as ``OU`` (see :mod:`protocols.deploy`), so a TLS
peer can be checked against the device it claims to be. The same key signs deploy manifests
(``ecdsa-p256-sha256``), which agents verify with the CA certificate they already trust.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.errors import PairingError, StateError
from hostkit.files import write_atomic

CA_KEY_FILE = "ca_key.pem"
CA_CERT_FILE = "ca_cert.pem"
CERT_LIFETIME = dt.timedelta(days=365)
SIGNATURE_ALGORITHM = "ecdsa-p256-sha256"


@dataclass(frozen=True)
class IssuedCertificate:
    """A certificate the CA issued, in PEM, with its SHA-256 fingerprint (hex, over DER)."""

    pem: bytes
    fingerprint: str


class CertificateAuthority:
    """Loads or creates the CA in a state dir, issues certificates and signs bytes."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self._cert = cert

    @classmethod
    def open(cls, state_dir: Path, name: str = "fedshard-ca") -> CertificateAuthority:
        """The CA stored in ``state_dir``, created on first use."""
        key_path, cert_path = state_dir / CA_KEY_FILE, state_dir / CA_CERT_FILE
        if key_path.exists() != cert_path.exists():
            raise StateError(f"{state_dir} has only one of {CA_KEY_FILE} and {CA_CERT_FILE}")
        if key_path.exists():
            return cls._load(key_path, cert_path)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _self_signed_ca(key, name)
        pem_key = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_atomic(key_path, pem_key, mode=0o600)
        write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(key, cert)

    @classmethod
    def _load(cls, key_path: Path, cert_path: Path) -> CertificateAuthority:
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot load the CA: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise StateError(f"{key_path} is not an EC key")
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        """The CA certificate every party trusts."""
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, csr_pem: bytes, name: str, role: str) -> IssuedCertificate:
        """Certify the key of a certificate request as device ``name`` with ``role``.

        The request's own subject is ignored: the CA decides the name. The request must be
        signed by the key it carries (proof of possession).
        """
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise PairingError(f"not a PEM certificate request: {exc}") from exc
        if not csr.is_signature_valid:
            raise PairingError("the certificate request is not signed by its own key")
        return self.issue_for_key(csr.public_key(), name, role)

    def issue_for_key(
        self,
        public_key: CertificatePublicKeyTypes,
        name: str,
        role: str,
        ip_addresses: Sequence[str] = (),
    ) -> IssuedCertificate:
        """Certify ``public_key`` as device ``name`` with ``role`` (client and server use).

        ``ip_addresses`` are added as IP subject alternative names, for servers that clients
        reach by address (the Flower SuperLink on 127.0.0.1).
        """
        alt_names: list[x509.GeneralName] = [x509.DNSName(name)]
        alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        now = dt.datetime.now(dt.UTC)
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, name),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + CERT_LIFETIME)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return IssuedCertificate(
            pem=cert.public_bytes(serialization.Encoding.PEM),
            fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
        )

    def sign(self, data: bytes) -> bytes:
        """ECDSA P-256 / SHA-256 signature (DER) over ``data``."""
        return self._key.sign(data, ec.ECDSA(hashes.SHA256()))


def _self_signed_ca(key: ec.EllipticCurvePrivateKey, name: str) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
