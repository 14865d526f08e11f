"""Hostile pairing and revocation (issue 19, items 1, 2, 7), with real agent processes.

- A device may not call itself ``coordinator``: the agent refuses the name, the coordinator
  refuses its offers, and a revocation list naming ``coordinator`` (what revoking such a rogue
  pushed before) never locks the coordinator out: names revoke agent-role certificates only.
- A foreign CA cannot capture an unpaired agent: its grant does not prove knowledge of the code
  the agent shows, so the agent refuses it, stays unpaired, and the real coordinator pairs it.
- A same-name rogue cannot replace a device's pending request, and offers never rewrite
  ``pairings.json``: a real coordinator, the real agent and a rogue agent with the same name.
"""

from __future__ import annotations

import json
import socket
import ssl
import stat
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from agent_helpers import PYTHON, REPO, TestCA, control_client, start_agent, stop_agent
from coordinator_helpers import pairing_code, start_coordinator, stop_process, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pairing_helpers import code_for, make_csr, request_code

from coordinator.errors import PairingError
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.offers import MAX_PER_NAME, OfferTableFullError
from coordinator.trust.pairing import Pairing
from protocols.deploy import ROLE_AGENT, Revocations
from protocols.pairing import CODE_FILE, PairingGrant, PairingOffer, grant_proof, pairing_key

pytestmark = pytest.mark.timeout(180)


def _anonymous() -> httpx.Client:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return httpx.Client(verify=ctx, timeout=30, trust_env=False)


def test_an_agent_cannot_be_named_coordinator(tmp_path: Path) -> None:
    command = [PYTHON, "-m", "edge_agent", "agent", "--name", "coordinator", "--memory", "64MiB"]
    command += ["--state-dir", str(tmp_path / "rogue"), "--interface", "127.0.0.1"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "reserved" in result.stdout + result.stderr
    pairing = Pairing(tmp_path / "c", CertificateAuthority.open(tmp_path / "c"))
    with pytest.raises(PairingError, match="reserved"):
        request_code(pairing, "coordinator")
    with pytest.raises(PairingError, match="unknown device"):
        pairing.revoke("coordinator")  # never pending, never paired: nothing to revoke
    assert pairing.book().revoked_names == []


def test_a_revoked_name_never_matches_the_coordinators_certificate(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    state = tmp_path / "state-a0"
    state.mkdir()
    revoked = Revocations(names=["coordinator", "a1"], fingerprints=[])
    (state / "revocations.json").write_text(revoked.model_dump_json())
    agent = start_agent(tmp_path, "a0", ca, memory="64MiB")
    try:
        with control_client(ca) as coordinator:  # CN=coordinator, OU=coordinator
            assert coordinator.get(agent.url("/v1/status")).status_code == 200
        with control_client(ca, "a1", ROLE_AGENT) as a1, pytest.raises(httpx.TransportError):
            a1.get(agent.url("/v1/status"))  # the revoked agent is refused
        with control_client(ca, "a2", ROLE_AGENT) as a2:  # other agents are admitted (and
            assert a2.get(agent.url("/v1/status")).status_code == 403  # status is not theirs)
        with control_client(ca) as coordinator:
            assert coordinator.get(agent.url("/v1/status")).json()["paired"] is True
    finally:
        stop_agent(agent)


def test_a_foreign_ca_cannot_capture_an_unpaired_agent(tmp_path: Path) -> None:
    ca, foreign = TestCA(tmp_path / "ca"), TestCA(tmp_path / "foreign")
    agent = start_agent(tmp_path, "edge1", None, memory="64MiB")
    try:
        assert stat.S_IMODE(agent.state_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((agent.state_dir / "pairing-secret").stat().st_mode) == 0o600
        with _anonymous() as anon:
            offer = PairingOffer.from_json(anon.get(agent.url("/v1/pairing")).content)
            assert offer.code is None  # nothing on the wire gives the code away
            # a valid certificate for the agent's own key, name and role, from another CA
            cert = foreign.certify(offer.csr_pem, "edge1")
            ca_pem = foreign.ca_path.read_text()
            guessed = pairing_key("AAAA-AAAA", _spki(offer.csr_pem))
            for proof in (None, "0" * 64, grant_proof(guessed, ca_pem, cert)):
                grant = PairingGrant(ca_pem=ca_pem, cert_pem=cert, proof=proof)
                refused = anon.post(agent.url("/v1/pairing"), content=grant.model_dump_json())
                assert refused.status_code == 409 and "pairing code" in refused.text
            assert anon.get(agent.url("/v1/pairing")).status_code == 200  # still unpaired
            code = (agent.state_dir / CODE_FILE).read_text().strip()
            key = pairing_key(code, _spki(offer.csr_pem))
            real_ca, real_cert = ca.ca_path.read_text(), ca.certify(offer.csr_pem, "edge1")
            grant = PairingGrant(
                ca_pem=real_ca, cert_pem=real_cert, proof=grant_proof(key, real_ca, real_cert)
            )
            assert anon.post(agent.url("/v1/pairing"), content=grant.model_dump_json()).json()[
                "paired"
            ]
        assert (agent.state_dir / "ca.pem").read_text() == real_ca
        with control_client(ca) as client:
            assert client.get(agent.url("/v1/status")).json()["paired"] is True
        with control_client(foreign) as stranger, pytest.raises(httpx.TransportError):
            stranger.get(agent.url("/v1/status"))
    finally:
        stop_agent(agent)


def test_a_same_name_rogue_cannot_take_a_devices_pairing(tmp_path: Path) -> None:
    coordinator = start_coordinator(tmp_path)
    real = rogue = None
    try:
        real = start_agent(tmp_path / "real", "edge", None, memory="64MiB")
        rogue = start_agent(tmp_path / "rogue", "edge", None, memory="64MiB")
        book = coordinator.state_dir / "pairings.json"
        with coordinator.client() as api:

            def offers() -> list[dict[str, object]]:
                return [p for p in api.get("/v1/pairing").json()["pending"] if p["name"] == "edge"]

            assert wait_for(lambda: len(offers()) == 2, 30), api.get("/v1/pairing").text
            before = book.stat().st_mtime_ns if book.exists() else None
            result = coordinator.cli("pair", "edge", pairing_code(real))
            assert result.returncode == 0, result.stdout + result.stderr

            def statuses() -> dict[str, str]:
                devices = api.get("/v1/devices").json()
                return {d["fingerprint"]: d["status"] for d in devices if d["name"] == "edge"}

            assert wait_for(lambda: sorted(statuses().values()) == ["impostor", "paired"], 30), (
                statuses()
            )
            paired = json.loads(book.read_text())["paired"]
            assert [d["name"] for d in paired] == ["edge"]
            assert before is None or book.stat().st_mtime_ns != before
        with _anonymous() as anon:  # the rogue never got a certificate it could use
            assert anon.get(rogue.url("/v1/pairing")).status_code == 200
        assert "paired: certificate" in real.log()
        assert "pairing code" in rogue.log() and "paired: certificate" not in rogue.log()
    finally:
        for agent in (real, rogue):
            if agent is not None:
                stop_agent(agent)
        stop_process(coordinator.proc)


def test_fake_offers_can_neither_evict_real_ones_nor_rewrite_the_book(tmp_path: Path) -> None:
    pairing = Pairing(tmp_path, CertificateAuthority.open(tmp_path))
    real_csr = make_csr("nas")
    code, offered, _ = code_for(real_csr)
    pairing.request("nas", real_csr, commitment=offered)
    for _ in range(MAX_PER_NAME - 1):  # same-name rogues, each with its own key and code
        request_code(pairing, "nas")
    with pytest.raises(OfferTableFullError):
        request_code(pairing, "nas")
    for i in range(64):  # fake offers under other names do not push the real one out
        request_code(pairing, f"fake-{i}")
    assert not (tmp_path / "pairings.json").exists()  # offers never touch the book
    assert len(pairing.book().pending) == MAX_PER_NAME + 64
    device = pairing.approve("nas", code)
    issued = x509.load_pem_x509_certificate(device.cert_pem.encode())
    assert _der(issued.public_key()) == _spki(real_csr)  # the real offer, not a rogue's
    assert [p.name for p in pairing.book().pending if p.name == "nas"] == []


def _spki(csr_pem: str) -> bytes:
    return _der(x509.load_pem_x509_csr(csr_pem.encode()).public_key())


def _der(public_key: object) -> bytes:
    return public_key.public_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def test_a_client_reporting_a_huge_example_count_does_not_dominate_the_average() -> None:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from coordinator.training.strategy import capped_examples

    def reply(value: float, examples: int) -> tuple[None, FitRes]:
        arrays = ndarrays_to_parameters([np.full(3, value, np.float32)])
        return None, FitRes(Status(Code.OK, ""), arrays, examples, {})

    results = [reply(0.0, 50), reply(0.0, 50), reply(30.0, 10**9)]  # the liar claims 10^9
    for cap, expected in ((1.0, 10.0), (1000.0, 30.0 * 1000 / 1100)):  # DP: equal weights
        averaged, _ = FedAvg().aggregate_fit(1, capped_examples(results, cap), [])  # type: ignore[arg-type]
        assert averaged is not None
        np.testing.assert_allclose(parameters_to_ndarrays(averaged)[0], expected, rtol=1e-5)
    uncapped, _ = FedAvg().aggregate_fit(1, results, [])  # type: ignore[arg-type]
    assert uncapped is not None and parameters_to_ndarrays(uncapped)[0][0] > 29.99  # the attack


def test_the_coordinators_certificate_is_renewed_before_it_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime as dt

    from coordinator.trust import ca as ca_module
    from coordinator.trust.identity import open_identity

    authority = CertificateAuthority.open(tmp_path)
    monkeypatch.setattr(ca_module, "CERT_LIFETIME", dt.timedelta(days=10))
    first = open_identity(tmp_path, authority)
    old = x509.load_pem_x509_certificate(first.cert_path.read_bytes())
    monkeypatch.setattr(ca_module, "CERT_LIFETIME", dt.timedelta(days=365))
    again = open_identity(tmp_path, authority)  # the next start: 10 days left, renewed
    new = x509.load_pem_x509_certificate(again.cert_path.read_bytes())
    assert new.not_valid_after_utc - old.not_valid_after_utc > dt.timedelta(days=300)
    assert _der(new.public_key()) == _der(old.public_key())  # same key, same name and role
    assert new.subject == old.subject
    assert open_identity(tmp_path, authority).cert_path.read_bytes() == again.cert_path.read_bytes()


def test_an_agents_certificate_is_renewed_before_it_expires_and_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime as dt
    import hashlib

    from coordinator.fleet.registry import DeviceRegistry
    from coordinator.transport.agent_client import AgentAddress, AgentClient
    from coordinator.transport.tls import client_context
    from coordinator.trust import ca as ca_module
    from coordinator.trust.delivery import TrustService
    from coordinator.trust.identity import open_identity
    from protocols.profile import AgentState, Announcement, DeviceProfile

    state = tmp_path / "coordinator"
    authority = CertificateAuthority.open(state)
    pairing, registry = Pairing(state, authority), DeviceRegistry()
    agents = AgentClient(client_context(open_identity(state, authority)))
    trust = TrustService(pairing, registry, authority, agents)
    agent = start_agent(tmp_path, "edge", None, memory="64MiB")

    def announce(fingerprint: str, paired: bool) -> None:
        profile = DeviceProfile(
            device_id=agent.device_id,
            name="edge",
            memory_bytes=64 << 20,
            gflops=1.0,
            control_port=agent.control_port,
            data_port=agent.data_port,
            cert_fingerprint=fingerprint,
        )
        announced = Announcement(profile=profile, state=AgentState(paired=paired))
        registry.announce(announced, "127.0.0.1", "edge-svc")

    def presented() -> str:
        ctx = client_context(open_identity(state, authority))
        with (
            socket.create_connection(("127.0.0.1", agent.control_port), timeout=10) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            return hashlib.sha256(tls.getpeercert(binary_form=True) or b"").hexdigest()

    try:
        with _anonymous() as anon:
            offer = PairingOffer.from_json(anon.get(agent.url("/v1/pairing")).content)
        announce(hashlib.sha256(_spki(offer.csr_pem)).hexdigest(), paired=False)
        trust.poll_once()
        monkeypatch.setattr(ca_module, "CERT_LIFETIME", dt.timedelta(days=30))  # about to expire
        first = trust.approve("edge", (agent.state_dir / CODE_FILE).read_text().strip())
        announce(first.fingerprint, paired=True)
        assert presented() == first.fingerprint
        monkeypatch.setattr(ca_module, "CERT_LIFETIME", dt.timedelta(days=365))
        trust.poll_once()  # renews and sends the new certificate
        [renewed] = pairing.book().paired
        assert renewed.previous_fingerprint == first.fingerprint != renewed.fingerprint
        assert presented() == renewed.fingerprint  # new connections use the new certificate
        assert pairing.is_trusted("edge", first.fingerprint)  # until the agent announces it
        announce(renewed.fingerprint, paired=True)
        status = agents.status(AgentAddress("edge", "127.0.0.1", agent.control_port))
        assert status.paired
        trust.poll_once()
        assert pairing.book().paired == [renewed]  # not renewed again
        pairing.revoke("edge")
        assert {first.fingerprint, renewed.fingerprint} <= set(pairing.book().revoked_fingerprints)
    finally:
        stop_agent(agent)
