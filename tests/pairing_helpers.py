"""Pairing offers as an agent makes them (``fedshard.pairing/2``), for the coordinator's tests."""

from __future__ import annotations

from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocols.pairing import commitment, new_secret, pairing_key, secret_code


def make_csr(name: str = "agent") -> str:
    """A PEM certificate request for a fresh P-256 key."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def code_for(csr_pem: str) -> tuple[str, str, bytes]:
    """(code the agent would show, the offer's commitment, the grant key) for a request's key."""
    public = x509.load_pem_x509_csr(csr_pem.encode()).public_key()
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    code = secret_code(new_secret(), der)
    key = pairing_key(code, der)
    return code, commitment(key), key


def request_code(pairing: Any, name: str, csr_pem: str | None = None, **kwargs: Any) -> str:
    """Record an offer for ``name`` as an agent would send it; returns the code it shows."""
    csr = csr_pem or make_csr(name)
    code, offered, _ = code_for(csr)
    pairing.request(name, csr, commitment=offered, **kwargs)
    return code
