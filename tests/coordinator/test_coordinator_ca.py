"""The coordinator's CA: key mode, reload, issued certificates and signatures."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coordinator.errors import PairingError, StateError
from coordinator.trust.ca import CA_CERT_FILE, CA_KEY_FILE, CertificateAuthority
from hostkit.files import write_atomic
from protocols.pairing import codes_match, pairing_code


def _csr(key: ec.EllipticCurvePrivateKey, cn: str = "whatever") -> bytes:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def test_ca_key_is_private_and_the_ca_survives_a_restart(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path)
    assert stat.S_IMODE((tmp_path / CA_KEY_FILE).stat().st_mode) == 0o600
    again = CertificateAuthority.open(tmp_path)
    assert again.cert_pem == ca.cert_pem


def test_issued_certificate_names_the_device_and_role_and_chains_to_the_ca(
    tmp_path: Path,
) -> None:
    ca = CertificateAuthority.open(tmp_path)
    key = ec.generate_private_key(ec.SECP256R1())
    issued = ca.issue(_csr(key, cn="i-claim-to-be-the-nas"), name="laptop", role="agent")
    cert = x509.load_pem_x509_certificate(issued.pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "laptop"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "agent"
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    assert issued.fingerprint == cert.fingerprint(hashes.SHA256()).hex()


def test_a_request_not_signed_by_its_key_is_refused(tmp_path: Path) -> None:
    ca = CertificateAuthority.open(tmp_path)
    pem = bytearray(_csr(ec.generate_private_key(ec.SECP256R1())))
    with pytest.raises(PairingError):
        ca.issue(b"garbage", name="x", role="agent")
    der = x509.load_pem_x509_csr(bytes(pem)).public_bytes(serialization.Encoding.DER)
    tampered = bytearray(der)
    tampered[-5] ^= 0xFF  # inside the signature
    tampered_pem = x509.load_der_x509_csr(bytes(tampered)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(PairingError):
        ca.issue(tampered_pem, name="x", role="agent")


def test_signatures_verify_with_the_ca_certificate_only_for_the_signed_bytes(
    tmp_path: Path,
) -> None:
    ca = CertificateAuthority.open(tmp_path)
    public = x509.load_pem_x509_certificate(ca.cert_pem).public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    signature = ca.sign(b"deploy manifest")
    public.verify(signature, b"deploy manifest", ec.ECDSA(hashes.SHA256()))
    with pytest.raises(InvalidSignature):
        public.verify(signature, b"deploy manifesT", ec.ECDSA(hashes.SHA256()))


def test_half_a_ca_is_a_state_error(tmp_path: Path) -> None:
    CertificateAuthority.open(tmp_path)
    (tmp_path / CA_CERT_FILE).unlink()
    with pytest.raises(StateError):
        CertificateAuthority.open(tmp_path)


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_pairing_codes_are_short_stable_and_key_specific() -> None:
    def der(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    a, b = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    code = pairing_code(der(a))
    assert len(code) == 9 and code[4] == "-"
    assert pairing_code(der(a)) == code
    assert pairing_code(der(b)) != code
    assert codes_match(code, code.lower().replace("-", " "))
    assert not codes_match(code, pairing_code(der(b)))
