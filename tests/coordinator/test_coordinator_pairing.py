"""Pairing: codes, approval, wrong codes, revocation, and persistence across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from pairing_helpers import code_for, request_code

from coordinator.errors import PairingError, RevokedError, WrongCodeError
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing


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


def test_the_offer_carries_a_commitment_the_agents_code_opens(tmp_path: Path) -> None:
    _, csr = _key_and_csr()
    code, offered, _ = code_for(csr)
    pairing = _open(tmp_path)
    key_id = pairing.request("nas", csr, commitment=offered)
    [pending] = pairing.book().pending
    assert pending.key_id == key_id and pending.code is None  # the code is never known here
    with pytest.raises(PairingError, match="no code commitment"):
        pairing.request("old", csr)  # a fedshard.pairing/1 offer
    with pytest.raises(WrongCodeError):
        pairing.approve("nas", "AAAA-AAAA" if code != "AAAA-AAAA" else "BBBB-BBBB")
    assert pairing.approve("nas", code).name == "nas"


def test_approval_with_the_right_code_issues_a_certificate_for_the_agents_key(
    tmp_path: Path,
) -> None:
    pairing = _open(tmp_path)
    key, csr = _key_and_csr()
    code = request_code(pairing, "nas", csr)
    device = pairing.approve("nas", code.lower())
    cert = x509.load_pem_x509_certificate(device.cert_pem.encode())
    assert cert.public_key() == key.public_key()
    assert pairing.is_trusted("nas", device.fingerprint)
    assert not pairing.book().pending


def test_a_wrong_code_is_refused_and_nothing_is_issued(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    request_code(pairing, "nas", csr)
    with pytest.raises(WrongCodeError):
        pairing.approve("nas", "AAAA-AAAA")
    with pytest.raises(PairingError):
        pairing.approve("laptop", "AAAA-AAAA")
    assert not pairing.book().paired


def test_revocation_is_permanent_and_survives_a_restart(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    device = pairing.approve("nas", request_code(pairing, "nas", csr))
    pairing.revoke("nas")
    reopened = _open(tmp_path)
    assert not reopened.is_trusted("nas", device.fingerprint)
    with pytest.raises(RevokedError):
        request_code(reopened, "nas", _key_and_csr()[1])


def test_pairings_survive_a_restart(tmp_path: Path) -> None:
    pairing = _open(tmp_path)
    _, csr = _key_and_csr()
    device = pairing.approve("nas", request_code(pairing, "nas", csr))
    _, csr2 = _key_and_csr()
    code2, offered2, _ = code_for(csr2)
    pairing.request("sbc", csr2, commitment=offered2)
    reopened = _open(tmp_path)
    assert reopened.is_trusted("nas", device.fingerprint)
    assert reopened.book().pending == []  # offers live in memory: the agent offers again
    reopened.request("sbc", csr2, commitment=offered2)
    assert reopened.approve("sbc", code2).name == "sbc"


def test_a_garbage_request_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PairingError):
        _open(tmp_path).request(
            "nas", "-----BEGIN CERTIFICATE REQUEST-----\nxx\n", commitment="0" * 64
        )
