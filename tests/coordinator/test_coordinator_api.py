"""Coordinator API: token required, pairing through the API, device status in the listing."""

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
from coordinator.trust.pairing import Pairing
from protocols.profile import Announcement, DeviceProfile

TOKEN = "secret-token"


def _client(tmp_path: Path) -> tuple[TestClient, Services]:
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
    )
    return TestClient(create_app(services)), services


def _csr() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def test_every_route_needs_the_token(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    for path in ("/v1/devices", "/v1/pairing", "/v1/models"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert client.get(f"{path}?token={TOKEN}").status_code == 401  # only the console's page


def test_pairing_through_the_api_and_device_status(tmp_path: Path) -> None:
    client, services = _client(tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    code = request_code(services.pairing, "nas", _csr())
    wrong = client.post(
        "/v1/pairing/approve", json={"name": "nas", "code": "AAAA-AAAA"}, headers=auth
    )
    assert wrong.status_code == 403
    ok = client.post("/v1/pairing/approve", json={"name": "nas", "code": code}, headers=auth)
    assert ok.status_code == 200
    fingerprint = ok.json()["fingerprint"]
    profile = DeviceProfile(
        device_id="ab" * 8,
        name="nas",
        memory_bytes=1 << 30,
        gflops=3.0,
        control_port=9000,
        data_port=9001,
        cert_fingerprint=fingerprint,
    )
    services.registry.announce(Announcement(profile=profile), "127.0.0.1", "nas-svc")
    [device] = client.get("/v1/devices", headers=auth).json()
    assert device["status"] == "paired"
    assert client.post("/v1/pairing/revoke", json={"name": "nas"}, headers=auth).status_code == 200
    [device] = client.get("/v1/devices", headers=auth).json()
    assert device["status"] == "revoked"


def test_bad_bodies_get_400_not_a_crash(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/v1/pairing/approve", content=b"{", headers=auth).status_code == 400
    extra = {"name": "a", "code": "b", "surprise": 1}
    assert client.post("/v1/pairing/approve", json=extra, headers=auth).status_code == 400
    assert (
        client.post("/v1/pairing/revoke", json={"name": "ghost"}, headers=auth).status_code == 404
    )


def test_console_page_is_served_and_holds_no_data(tmp_path: Path) -> None:
    client, _ = _client(tmp_path)
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    script = client.get("/console/app.js").text  # the page's script calls the API
    assert "/v1/pairing/approve" in script and TOKEN not in page.text + script
