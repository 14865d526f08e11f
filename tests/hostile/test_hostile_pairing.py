"""Guessing pairing codes: wrong codes are rate-limited per device and overall, with 429 and
Retry-After, and a lock holds even against the right code until it expires; approvals for a
device whose request has not arrived are not guesses and lock nobody out."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient
from pairing_helpers import request_code

from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import AttemptLimits, Pairing

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = AttemptLimits(per_device=3, overall=5, window_s=60.0, lockout_s=120.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(tmp_path: Path) -> tuple[TestClient, Pairing, Clock]:
    clock = Clock()
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path), LIMITS, clock)
    app = create_app(Services(TOKEN, DeviceRegistry(), pairing))
    return TestClient(app), pairing, clock


def _request(pairing: Pairing, name: str) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    return request_code(pairing, name, csr.public_bytes(serialization.Encoding.PEM).decode())


def _approve(client: TestClient, name: str, code: str) -> tuple[int, str, str | None]:
    response = client.post("/v1/pairing/approve", json={"name": name, "code": code}, headers=AUTH)
    return response.status_code, response.json()["detail"], response.headers.get("Retry-After")


def test_wrong_codes_lock_the_device_then_expire(tmp_path: Path) -> None:
    client, pairing, clock = _setup(tmp_path)
    code = _request(pairing, "nas")
    for _ in range(LIMITS.per_device):
        assert _approve(client, "nas", "AAAA-AAAA")[0] == 403
    status, detail, retry_after = _approve(client, "nas", code)  # even the right code
    assert (status, retry_after) == (429, "120")
    assert "too many wrong pairing codes for device 'nas'" in detail
    clock.now += 60
    assert _approve(client, "nas", code)[2] == "60"
    assert pairing.book().paired == []
    clock.now += 61
    response = client.post("/v1/pairing/approve", json={"name": "nas", "code": code}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert [d.name for d in pairing.book().paired] == ["nas"]


def test_one_locked_device_does_not_lock_another(tmp_path: Path) -> None:
    client, pairing, _ = _setup(tmp_path)
    _request(pairing, "nas")
    sbc = _request(pairing, "sbc")
    for _ in range(LIMITS.per_device):
        _approve(client, "nas", "AAAA-AAAA")
    assert _approve(client, "nas", "AAAA-AAAA")[0] == 429
    assert (
        client.post(
            "/v1/pairing/approve", json={"name": "sbc", "code": sbc}, headers=AUTH
        ).status_code
        == 200
    )


def test_guessing_across_devices_locks_every_approval(tmp_path: Path) -> None:
    client, pairing, clock = _setup(tmp_path)
    codes = {name: _request(pairing, name) for name in ("a", "b", "c")}
    # spread under the per-device limit; names with no request at all are not guesses
    guesses = [("a", "AAAA-AAAA"), ("b", "AAAA-AAAA"), ("c", "AAAA-AAAA"), ("a", "CCCC-CCCC")]
    for name, guess in guesses:
        assert _approve(client, name, guess)[0] == 403
    assert _approve(client, "ghost", "AAAA-AAAA")[0] == 404
    assert _approve(client, "b", "BBBB-BBBB")[0] == 403  # the fifth failure sets the lock
    status, detail, retry_after = _approve(client, "c", codes["c"])
    assert (status, retry_after) == (429, "120") and "all devices" in detail
    clock.now += LIMITS.lockout_s + 1
    response = client.post(
        "/v1/pairing/approve", json={"name": "c", "code": codes["c"]}, headers=AUTH
    )
    assert response.status_code == 200, response.text


def test_failures_outside_the_window_are_forgotten(tmp_path: Path) -> None:
    client, pairing, clock = _setup(tmp_path)
    code = _request(pairing, "nas")
    for _ in range(10):  # slower than per_device per window: never locked
        assert _approve(client, "nas", "AAAA-AAAA")[0] == 403
        clock.now += LIMITS.window_s / (LIMITS.per_device - 1) + 1
    assert (
        client.post(
            "/v1/pairing/approve", json={"name": "nas", "code": code}, headers=AUTH
        ).status_code
        == 200
    )


def test_pairing_before_the_request_arrives_locks_nobody_out(tmp_path: Path) -> None:
    client, pairing, _ = _setup(tmp_path)
    other = _request(pairing, "sbc")
    for _ in range(LIMITS.overall * 3):  # `fedshard pair nas CODE` retrying early
        assert _approve(client, "nas", "AAAA-AAAA")[0] == 404
    code = _request(pairing, "nas")
    assert (
        client.post(
            "/v1/pairing/approve", json={"name": "nas", "code": code}, headers=AUTH
        ).status_code
        == 200
    )
    assert (
        client.post(
            "/v1/pairing/approve", json={"name": "sbc", "code": other}, headers=AUTH
        ).status_code
        == 200
    )
