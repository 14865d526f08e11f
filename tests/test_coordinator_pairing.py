"""Pairing: codes, approval, wrong codes, revocation, and persistence across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coordinator.errors import PairingError, RevokedError, WrongCodeError
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from protocols.pairing import pairing_code


def _key_and_csr() -> tuple[ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agent")]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def _open(state: Path) -> Pairing:
    return Pairing(state, CertificateAuthority.open(state))


def test_the_code_the_coordinator_shows_is_the_one_the_agent_derives(tmp_path: Path) -> None:
    key, csr = _key_and_csr()
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert _open(tmp_path).request("nas", csr) == pairing_code(spki)


def test_approval_with_the_right_code_issues_a_certificate_for_the_agents_key(
    tmp_path: Path,
) -> None:
    pairing = _open(tmp_path)
    key, csr = _key_and_csr()
    code = pairing.request("nas", csr)
    device = pairing.approve("nas", code.lower())
    cert = x509.load_pem_x509_certificate(device.cert_pem.encode())
    assert cert.public_key() == key.public_key()
    assert pairing.is_trusted("nas", device.fingerprint)
    assert not pairing.book().pending


def test_a_wrong_code_is_refused_and_nothing_is_issued(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    pairing.request("nas", csr)
    with pytest.raises(WrongCodeError):
        pairing.approve("nas", "AAAA-AAAA")
    with pytest.raises(PairingError):
        pairing.approve("laptop", "AAAA-AAAA")
    assert not pairing.book().paired


def test_revocation_is_permanent_and_survives_a_restart(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    device = pairing.approve("nas", pairing.request("nas", csr))
    pairing.revoke("nas")
    reopened = _open(tmp_path)
    assert not reopened.is_trusted("nas", device.fingerprint)
    with pytest.raises(RevokedError):
        reopened.request("nas", _key_and_csr()[1])


def test_pairings_survive_a_restart(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    device = pairing.approve("nas", pairing.request("nas", csr))
    _, csr2 = _key_and_csr()
    code2 = pairing.request("sbc", csr2)
    reopened = _open(tmp_path)
    assert reopened.is_trusted("nas", device.fingerprint)
    assert reopened.approve("sbc", code2).name == "sbc"


def test_a_garbage_request_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PairingError):
        _open(tmp_path).request("nas", "-----BEGIN CERTIFICATE REQUEST-----\nxx\n")
