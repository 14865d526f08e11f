"""Trust decisions with fakes: re-announcement after pairing, impostors, who gets planned on."""

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
from coordinator.transport.agent_client import AgentClient
from coordinator.transport.tls import client_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.delivery import TrustService
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing
from protocols.profile import AgentState, Announcement, DeviceProfile


def _csr() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def _announce(registry: DeviceRegistry, name: str, fingerprint: str, service: str, paired: bool):  # type: ignore[no-untyped-def]
    profile = DeviceProfile(
        device_id="ab" * 8,
        name=name,
        memory_bytes=1 << 30,
        gflops=5.0,
        control_port=9000,
        data_port=9001,
        cert_fingerprint=fingerprint,
    )
    state = AgentState(paired=paired)
    return registry.announce(Announcement(profile=profile, state=state), "127.0.0.1", service)


def test_paired_reannouncement_replaces_the_unpaired_record_and_impostors_stay_out(
    tmp_path: Path,
) -> None:
    ca = CertificateAuthority.open(tmp_path)
    pairing, registry = Pairing(tmp_path, ca), DeviceRegistry()
    agents = AgentClient(client_context(open_identity(tmp_path, ca)))
    trust = TrustService(pairing, registry, ca, agents)
    _announce(registry, "nas", "1" * 64, "nas-svc", paired=False)
    code = request_code(pairing, "nas", _csr())
    device = pairing.approve("nas", code)
    assert trust.trusted() == []  # still announcing the self-signed certificate
    _announce(registry, "nas", device.fingerprint, "nas-svc", paired=True)
    assert [r.fingerprint for r in registry.devices()] == [device.fingerprint]
    assert [r.name for r in trust.trusted()] == ["nas"]
    # another key announcing the paired name, even claiming to be paired: never trusted
    _announce(registry, "nas", "2" * 64, "nas-evil-svc", paired=True)
    assert [r.fingerprint for r in trust.trusted()] == [device.fingerprint]
    app = create_app(Services("tok", registry, pairing, trust))
    listed = TestClient(app).get("/v1/devices", headers={"Authorization": "Bearer tok"}).json()
    assert {d["fingerprint"]: d["status"] for d in listed} == {
        device.fingerprint: "paired",
        "2" * 64: "impostor",
    }
    assert trust.revoke("nas") == []  # the agent is not reachable: nobody could be told
    assert trust.trusted() == []
