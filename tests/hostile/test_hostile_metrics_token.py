"""An agent's ``/v1/status`` and ``/metrics``: the coordinator, or a scraper with the token the
operator set (``fedshard agent --metrics-token-file``), and nobody else.

One real agent process with a token file: a paired agent's certificate, a wrong token, no token,
a certificate from another CA with the right token, and the right token on a route it does not
open are all refused; the coordinator and a scraper without a certificate but with the right
token are served. Without a token file the control plane still asks every caller for a
certificate.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
from agent_helpers import TestCA, control_client, start_agent, stop_agent, tls_identity

from edge_agent.config import AgentConfig, read_metrics_token
from edge_agent.errors import ConfigError
from edge_agent.net.tls import control_context
from protocols.deploy import ROLE_AGENT

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-scraper-token-0123456789"


def _scraper(
    ca: TestCA, token: str | None, cert_from: TestCA | None = None, scheme: str = "Bearer"
) -> httpx.Client:
    """A TLS client that verifies the agent against ``ca``, with no certificate of its own
    (or one issued by ``cert_from``), sending ``token`` in ``Authorization: SCHEME token``."""
    if cert_from is not None:
        ctx = cert_from.client_context("scraper", ROLE_AGENT)
        ctx.load_verify_locations(cafile=str(ca.ca_path))
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(cafile=str(ca.ca_path))
    headers = {"Authorization": f"{scheme} {token}"} if token is not None else {}
    return httpx.Client(verify=ctx, headers=headers, timeout=30, trust_env=False)


def test_status_and_metrics_go_to_the_coordinator_or_the_token_only(tmp_path: Path) -> None:
    ca, foreign = TestCA(tmp_path / "ca"), TestCA(tmp_path / "foreign")
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    agent = start_agent(
        tmp_path, "a0", ca, memory="64MiB", extra=["--metrics-token-file", str(token_file)]
    )
    status, metrics = agent.url("/v1/status"), agent.url("/metrics")
    try:
        with control_client(ca) as coordinator:
            assert coordinator.get(status).json()["name"] == "a0"
            assert coordinator.get(metrics).status_code == 200
        # a paired agent: its certificate is valid, the routes are not its own
        with control_client(ca, "a1", ROLE_AGENT) as peer:
            for url in (status, metrics):
                refused = peer.get(url)
                assert refused.status_code == 403, refused.text
                assert "metrics token" in refused.json()["message"]
                wrong = peer.get(url, headers={"Authorization": f"Bearer {TOKEN[:-1]}x"})
                assert wrong.status_code == 403
        for token, scheme in [(None, "Bearer"), (TOKEN[:-1], "Bearer"), (TOKEN + "x", "Bearer"),
                              (TOKEN.upper(), "Bearer"), (TOKEN, "Basic")]:  # fmt: skip
            with _scraper(ca, token, scheme=scheme) as nobody:
                assert nobody.get(status).status_code == 403, token
                assert nobody.get(metrics).status_code == 403, token
        with _scraper(ca, TOKEN) as scraper:
            assert scraper.get(status).json()["paired"] is True
            served = scraper.get(metrics)
            assert served.status_code == 200 and "fedshard_" in served.text
            # the token opens those two routes, nothing else
            assert scraper.post(agent.url("/v1/unload"), content=b"{}").status_code == 403
            assert scraper.post(agent.url("/v1/revocations"), content=b"{}").status_code == 403
        # a certificate that is presented is still checked against the CA, token or not
        with (
            _scraper(ca, TOKEN, cert_from=foreign) as stranger,
            pytest.raises(httpx.TransportError),
        ):
            stranger.get(status)
        with control_client(ca) as coordinator:  # and the agent still serves its coordinator
            assert coordinator.get(status).status_code == 200
    finally:
        stop_agent(agent)


def test_without_a_token_file_every_control_caller_needs_a_certificate(tmp_path: Path) -> None:
    identity = tls_identity(TestCA(tmp_path / "ca"), "a0", tmp_path)
    assert control_context(identity, scrapers=False).verify_mode == ssl.CERT_REQUIRED
    assert control_context(identity, scrapers=True).verify_mode == ssl.CERT_OPTIONAL


@pytest.mark.parametrize("text", ["short", "has a space in it, sixteen+", "é" * 20, ""])
def test_a_weak_or_malformed_token_file_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(ConfigError, match="metrics-token-file"):
        read_metrics_token(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_metrics_token(tmp_path / "missing")
    with pytest.raises(ConfigError, match="at least"):
        AgentConfig(name="a0", memory_bytes=1, state_dir=tmp_path, metrics_token=b"short")
    assert "s3cret" not in repr(
        AgentConfig(name="a0", memory_bytes=1, state_dir=tmp_path, metrics_token=TOKEN.encode())
    )
