"""Pairing, agent side, with a real agent process: code, certificate request, grant, restart."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import numpy as np
import pytest
from agent_helpers import (
    WIDTH,
    TestCA,
    chain_weights,
    control_client,
    deploy,
    manifest_for,
    start_agent,
    stop_agent,
    tiny_chain,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from devtools.requester import Requester
from edge_agent.net.discovery import ZeroconfBrowser
from protocols.deploy import Hop
from protocols.pairing import (
    CODE_FILE,
    PairingGrant,
    PairingOffer,
    commitment,
    grant_proof,
    pairing_key,
)

pytestmark = pytest.mark.timeout(120)


def _anonymous() -> httpx.Client:
    """What a coordinator has before pairing: TLS without a client certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # trust comes from the operator comparing codes
    return httpx.Client(verify=ctx, timeout=30, trust_env=False)


def test_pairing_by_code_then_serving_and_restart(tmp_path: Path) -> None:
    ca, rogue = TestCA(tmp_path / "ca"), TestCA(tmp_path / "rogue")
    agent = start_agent(tmp_path, "edge1", None, memory="64MiB")
    try:
        with _anonymous() as anon:
            offer = PairingOffer.from_json(anon.get(agent.url("/v1/pairing")).content)
            csr = x509.load_pem_x509_csr(offer.csr_pem.encode())
            spki = csr.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            code = (agent.state_dir / CODE_FILE).read_text().strip()
            assert f"pairing code {code}" in agent.log()  # shown to the operator, never sent
            assert offer.name == "edge1" and offer.code is None and code not in offer.csr_pem
            key = pairing_key(code, spki)
            assert offer.commitment == commitment(key)
            assert anon.get(agent.url("/v1/status")).status_code == 403
            other_key = rogue.issue("edge1")[0].read_text()
            ca_pem = ca.ca_path.read_text()
            proof = grant_proof(key, ca_pem, other_key)
            wrong = PairingGrant(ca_pem=ca_pem, cert_pem=other_key, proof=proof)
            refused = anon.post(agent.url("/v1/pairing"), content=wrong.model_dump_json())
            assert refused.status_code == 409 and "another key" in refused.text
            cert = ca.certify(offer.csr_pem, "edge1")
            grant = PairingGrant(ca_pem=ca_pem, cert_pem=cert, proof=grant_proof(key, ca_pem, cert))
            paired = anon.post(agent.url("/v1/pairing"), content=grant.model_dump_json())
            assert paired.status_code == 200, paired.text
            assert paired.json()["paired"] is True
        with control_client(ca) as client:
            assert client.get(agent.url("/v1/status")).json()["paired"] is True
            seg = tiny_chain()[0]
            chain = [Hop(device="edge1", host="127.0.0.1", data_port=agent.data_port)]
            manifest = manifest_for(0, seg, chain, io=[(["x"], ["h"], ["h"])])
            assert deploy(client, agent, ca.sign(manifest), seg).status_code == 200

        async def one_request() -> np.ndarray:
            requester = await Requester.connect(chain[0], ca.client_context("req"), 1)
            try:
                return (await requester.infer({"x": x}))["h"]
            finally:
                await requester.close()

        x = np.ones((2, WIDTH), np.float32)
        np.testing.assert_allclose(asyncio.run(one_request()), x @ chain_weights()["w0"], rtol=1e-6)
        browser = ZeroconfBrowser("127.0.0.1")
        try:
            found = browser.wait_for(
                lambda s: any(a.profile.name == "edge1" and a.state.paired for a in s.values()), 10
            )
            assert any(a.profile.name == "edge1" and a.state.paired for a in found.values())
        finally:
            browser.close()
        assert stop_agent(agent) == 0
        agent = start_agent(tmp_path, "edge1", None, memory="64MiB")  # no --ca/--cert/--key
        with control_client(ca) as client:
            assert client.get(agent.url("/v1/status")).json()["paired"] is True
        with _anonymous() as anon, pytest.raises(httpx.TransportError):
            anon.get(agent.url("/v1/pairing"))  # paired: no more anonymous handshakes
    finally:
        stop_agent(agent)
