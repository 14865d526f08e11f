"""Integration: real agent processes on 127.0.0.1, a signed chain, bad input of every kind.

Every bad-input test ends by checking that the agents still answer a good request.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from agent_helpers import (
    AGENT_NAMES,
    WIDTH,
    AgentProc,
    TestCA,
    agents,
    control_client,
    deploy,
    deploy_chain,
    manifest_for,
    start_agent,
    stop_agent,
    tiny_chain,
    tiny_reference,
)
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from devtools.requester import Requester
from edge_agent.errors import LinkError, RemoteRequestError
from edge_agent.net.discovery import ZeroconfBrowser
from protocols.deploy import ROLE_AGENT, Hop
from protocols.frames import PREFIX, FrameHeader, encode_frame

pytestmark = pytest.mark.timeout(180)
MAX_FRAME = 1 << 20


class Env:
    def __init__(self, tmp: Path, ca: TestCA, procs: list[AgentProc], client: httpx.Client) -> None:
        self.tmp, self.ca, self.procs, self.client = tmp, ca, procs, client
        self.requester_ctx = ca.client_context("requester")
        self.reports: list[dict[str, object]] = []

    @property
    def chain(self) -> list[Hop]:
        return [p.hop for p in self.procs]

    def run(self, coro_fn, *args):  # type: ignore[no-untyped-def]
        return asyncio.run(coro_fn(*args))

    async def infer(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        requester = await Requester.connect(self.chain, self.requester_ctx, 1)
        try:
            return await asyncio.wait_for(requester.infer(tensors), 20)
        finally:
            await requester.close()

    def assert_serves(self) -> None:
        x = np.random.default_rng(5).standard_normal((2, WIDTH)).astype(np.float32)
        y = asyncio.run(self.infer({"x": x}))["y"]
        np.testing.assert_allclose(y, tiny_reference(x), atol=1e-5)
        for proc in self.procs:
            assert proc.proc.poll() is None, proc.log()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("agents")
    ca = TestCA(tmp / "ca")
    extra = ["--max-frame", "1MiB"]
    with (
        agents(tmp, AGENT_NAMES, ca, memory="64MiB", extra=extra) as procs,
        control_client(ca) as client,
    ):
        e = Env(tmp, ca, procs, client)
        e.reports = deploy_chain(client, ca, procs, tiny_chain())
        yield e


def test_deploy_reports_measurements_next_to_predictions(env: Env) -> None:
    for report in env.reports:
        assert report["predicted_memory_bytes"] == 1 << 20
        assert isinstance(report["measured_memory_bytes"], int)
        assert float(report["warmup_s"]) > 0  # type: ignore[arg-type]
    status = env.client.get(env.procs[1].url("/v1/status")).json()
    assert status["segments"][0]["segment_index"] == 1 and status["memory_budget_bytes"] == 64 << 20


def test_100_requests_8_in_flight_match_the_whole_model(env: Env) -> None:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32) for i in range(100)]

    async def main() -> list[np.ndarray]:
        requester = await Requester.connect(env.chain, env.requester_ctx, 1)
        gate = asyncio.Semaphore(8)

        async def one(x: np.ndarray) -> np.ndarray:
            async with gate:
                return (await requester.infer({"x": x}))["y"]

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(x) for x in inputs)), 60)
        finally:
            await requester.close()

    for x, y in zip(inputs, asyncio.run(main()), strict=True):
        np.testing.assert_allclose(y, tiny_reference(x), atol=1e-5)


def test_zeroconf_finds_every_agent_with_its_profile(env: Env) -> None:
    browser = ZeroconfBrowser("127.0.0.1")
    try:
        found = browser.wait_for(
            lambda s: {a.profile.name for a in s.values()} >= set(AGENT_NAMES), 10
        )
    finally:
        browser.close()
    by_name = {a.profile.name: a for a in found.values()}
    for proc, segment in zip(env.procs, tiny_chain(), strict=True):
        announcement = by_name[proc.name]
        cert = x509.load_pem_x509_certificate((env.ca.directory / f"{proc.name}.pem").read_bytes())
        assert announcement.profile.cert_fingerprint == cert.fingerprint(hashes.SHA256()).hex()
        assert announcement.profile.device_id == proc.device_id
        assert announcement.profile.control_port == proc.control_port
        assert announcement.profile.data_port == proc.data_port
        assert announcement.profile.memory_bytes == 64 << 20
        assert announcement.profile.gflops > 0
        assert announcement.state.paired
        assert announcement.state.segment_sha256 == hashlib.sha256(segment).hexdigest()
        assert announcement.state.plan_version == 1


def _raw_tls(env: Env, port: int) -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return env.requester_ctx.wrap_socket(sock)


def _read_reply(sock: ssl.SSLSocket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_oversize_frame_gets_an_error_and_a_closed_connection(env: Env) -> None:
    with _raw_tls(env, env.procs[0].data_port) as sock:
        sock.sendall(PREFIX.pack(b"FSF1", 100, 2 * MAX_FRAME))
        reply = _read_reply(sock)
    assert b"frame_too_large" in reply
    env.assert_serves()


def test_truncated_frame_is_logged_and_closed(env: Env) -> None:
    frame = encode_frame(
        FrameHeader(request_id="cut", plan_version=1), {"x": np.ones((1, WIDTH), np.float32)}
    )
    with _raw_tls(env, env.procs[0].data_port) as sock:
        sock.sendall(frame[: len(frame) // 2])
        sock.unwrap()
    _wait_for_log(env.procs[0], "stream ended after")
    env.assert_serves()


def test_malformed_frame_header(env: Env) -> None:
    with _raw_tls(env, env.procs[0].data_port) as sock:
        sock.sendall(PREFIX.pack(b"FSF1", 5, 0) + b"{nope")
        assert b"bad_frame" in _read_reply(sock)
    env.assert_serves()


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"x": np.ones((1, WIDTH), np.float64)}, "expects float32"),
        ({"x": np.ones((1, WIDTH + 1), np.float32)}, "axis 1"),
        ({"x": np.ones((WIDTH,), np.float32)}, "rank"),
        ({"input": np.ones((1, WIDTH), np.float32)}, "missing input tensor 'x'"),
    ],
)
def test_wrong_dtype_shape_or_name(env: Env, tensors: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(RemoteRequestError, match=message):
        asyncio.run(env.infer(tensors))
    env.assert_serves()


def test_plaintext_client_is_refused(env: Env) -> None:
    frame = encode_frame(
        FrameHeader(request_id="plain", plan_version=1), {"x": np.ones((1, WIDTH), np.float32)}
    )
    for port in (env.procs[0].data_port, env.procs[0].control_port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(frame)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert b"FSF1" not in data  # nothing but, at most, a TLS alert
    _wait_for_log(env.procs[0], "refused data-plane connection")
    _wait_for_log(env.procs[0], "refused control-plane connection")
    env.assert_serves()


def test_client_certificate_from_another_ca_is_refused(env: Env) -> None:
    stranger = TestCA(env.tmp / "stranger")
    ctx = stranger.client_context("mallory")
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # mallory does not even check the server
    for port in (env.procs[1].data_port, env.procs[1].control_port):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _talk(ctx, port)
    _wait_for_log(env.procs[1], "certificate")
    env.assert_serves()


def test_agent_role_cannot_deploy(env: Env) -> None:
    seg = tiny_chain()[0]
    chain = [p.hop for p in env.procs]
    request = env.ca.sign(manifest_for(0, seg, chain, plan_version=7))
    with control_client(env.ca, "a1-impostor", "agent") as client:
        response = deploy(client, env.procs[0], request, seg)
        assert response.status_code == 403 and response.json()["error"] == "peer_rejected"
        assert client.get(env.procs[0].url("/v1/status")).status_code == 403  # coordinator only
    env.assert_serves()


def _bad_deploy(env: Env, mutate: str) -> httpx.Response:
    chain = [p.hop for p in env.procs]
    seg = tiny_chain()[0]
    if mutate == "hash":
        request = env.ca.sign(manifest_for(0, seg, chain, plan_version=2))
        seg = seg[:-1] + bytes([seg[-1] ^ 1])
    elif mutate == "signature":
        good = env.ca.sign(manifest_for(0, seg, chain, plan_version=2))
        request = env.ca.sign(manifest_for(0, seg, chain, plan_version=3))
        request = request.model_copy(update={"manifest": good.manifest})
    elif mutate == "budget":
        request = env.ca.sign(
            manifest_for(0, seg, chain, plan_version=2, predicted_memory=65 << 20)
        )
    else:
        seg = b"\x0a\x05hello, I am not ONNX" * 50
        request = env.ca.sign(manifest_for(0, seg, chain, plan_version=2))
    return deploy(env.client, env.procs[0], request, seg)


@pytest.mark.parametrize(
    ("mutate", "status", "error"),
    [
        ("hash", 400, "integrity"),
        ("signature", 403, "signature"),
        ("budget", 507, "over_budget"),
        ("onnx", 422, "segment_load"),
    ],
)
def test_bad_segments_are_refused(env: Env, mutate: str, status: int, error: str) -> None:
    response = _bad_deploy(env, mutate)
    assert response.status_code == status, response.text
    assert response.json()["error"] == error
    assert [
        s["report"]["plan_version"]
        for s in env.client.get(env.procs[0].url("/v1/status")).json()["segments"]
    ] == [1]
    env.assert_serves()


def test_metrics_show_the_stage_timings(env: Env) -> None:
    env.assert_serves()
    text = env.client.get(env.procs[1].url("/metrics")).text
    for name in (
        "fedshard_compute_seconds_count",
        "fedshard_queue_wait_seconds_count",
        "fedshard_send_seconds_count",
        "fedshard_bytes_in_total",
        "fedshard_bytes_out_total",
        "fedshard_idle_seconds_total",
        'fedshard_queue_depth{queue="compute"}',
        "fedshard_resident_memory_bytes",
        'fedshard_segment_resident_bytes{plan_version="1"}',
    ):
        assert name in text, name


def test_link_probe(env: Env) -> None:
    body = {"target": env.procs[1].hop.model_dump(), "payload_bytes": 512 * 1024, "rounds": 3}
    response = env.client.post(env.procs[0].url("/v1/probe"), json=body)
    assert response.status_code == 200, response.text
    report = response.json()
    assert (
        report["target"] == AGENT_NAMES[1]
        and report["bandwidth_mbps"] > 0
        and report["latency_ms"] > 0
    )


def test_revoked_devices_are_refused_on_both_planes(env: Env) -> None:
    mallory = env.ca.client_context("mallory", ROLE_AGENT)  # names revoke agents only

    async def connected_then_revoked() -> None:
        requester = await Requester.connect(env.chain, mallory, 1)
        try:
            x = np.ones((1, WIDTH), np.float32)
            await asyncio.wait_for(requester.infer({"x": x}), 10)  # served before revocation
            body = {"names": ["mallory"], "fingerprints": []}
            for proc in env.procs:
                response = env.client.post(proc.url("/v1/revocations"), json=body)
                assert response.status_code == 200, response.text
            with pytest.raises(LinkError):  # its open connection was dropped
                await asyncio.wait_for(requester.infer({"x": x}), 10)
        finally:
            await requester.close()

    asyncio.run(connected_then_revoked())
    for port in (env.procs[0].data_port, env.procs[0].control_port):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _talk(mallory, port)
    _wait_for_log(env.procs[0], "is revoked")
    assert (env.procs[0].state_dir / "revocations.json").exists()
    env.assert_serves()


def test_unpaired_agent_advertises_and_offers_only_pairing(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    agent = start_agent(tmp_path, "lonely", None, memory="16MiB")
    browser = ZeroconfBrowser("127.0.0.1")
    try:
        found = browser.wait_for(lambda s: any(a.profile.name == "lonely" for a in s.values()), 10)
        (announcement,) = [a for a in found.values() if a.profile.name == "lonely"]
        assert not announcement.state.paired
        ctx = ca.client_context("coordinator")
        ctx.verify_mode = ssl.CERT_NONE
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _talk(ctx, agent.data_port)
        with httpx.Client(verify=ctx, trust_env=False) as client:  # control: pairing only
            assert client.get(agent.url("/v1/status")).status_code == 403
            assert client.get(agent.url("/v1/pairing")).status_code == 200
        assert stop_agent(agent) == 0
        gone = browser.wait_for(lambda s: all(a.profile.name != "lonely" for a in s.values()), 5)
        assert all(a.profile.name != "lonely" for a in gone.values())
    finally:
        browser.close()
        stop_agent(agent)


def _talk(ctx: ssl.SSLContext, port: int) -> None:
    """Handshake, send a request, read a byte; raises when the agent refuses us."""
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10)) as sock:
        sock.sendall(b"GET /v1/status HTTP/1.1\r\n\r\n")
        if not sock.recv(1):
            raise ConnectionError("closed")


def _wait_for_log(proc: AgentProc, text: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log():
        assert time.monotonic() < deadline, f"{text!r} not in the log of {proc.name}:\n{proc.log()}"
        time.sleep(0.05)


def test_a_dead_agent_gets_the_requester_an_error_not_silence(tmp_path: Path) -> None:
    """A dead middle agent: an error frame from the first. A dead last agent: a failed link."""
    ca = TestCA(tmp_path / "ca")
    with agents(tmp_path, ["b0", "b1", "b2"], ca, extra=["--no-advertise"]) as procs:
        with control_client(ca) as client:
            deploy_chain(client, ca, procs, tiny_chain())
        chain = [p.hop for p in procs]
        x = np.ones((1, WIDTH), np.float32)

        async def main() -> None:
            requester = await Requester.connect(chain, ca.client_context("req"), 1)
            try:
                await asyncio.wait_for(requester.infer({"x": x}), 30)
                assert stop_agent(procs[1]) == 0
                with pytest.raises(RemoteRequestError, match="link_down: cannot reach b1"):
                    await asyncio.wait_for(requester.infer({"x": x}), 30)
                assert stop_agent(procs[2]) == 0
                with pytest.raises(LinkError, match="last agent"):
                    await asyncio.wait_for(requester.infer({"x": x}), 30)
            finally:
                await requester.close()

        asyncio.run(main())
