"""Limits before authentication (issue 19, items 3 and 5), on loopback with real sockets.

- The coordinator reads hosts that mDNS merely suggested under a size cap and a total deadline:
  a 300 MiB answer, an endless one and a drip cost it neither memory nor the pairing of a real
  agent announced beside them.
- The coordinator's API refuses bodies without a valid token, and oversized bodies, before it
  reads them (a real coordinator process; its resident memory stays put), while authorised
  requests keep being answered.
- An agent checks route, role and size before it reads a control-plane body, answers a
  connection that sends nothing with 408 and closes it, and bounds the frames its data plane
  is still receiving, all together, while an honest peer keeps being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from agent_helpers import (
    TestCA,
    control_client,
    request_id_recorder,
    start_agent,
    stop_agent,
    tls_identity,
)
from coordinator_helpers import start_coordinator, stop_process
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from coordinator.errors import AgentError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.transport import agent_client
from coordinator.transport.agent_client import AgentAddress, AgentClient, fetch_offer
from coordinator.transport.tls import client_context as coordinator_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.delivery import TrustService
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing
from edge_agent.net.channel import FrameServer
from edge_agent.net.control import ControlServer, Response, Route
from edge_agent.net.tls import Peer, client_context, server_context
from protocols.deploy import ROLE_AGENT
from protocols.frames import FrameHeader, encode_frame
from protocols.profile import AgentState, Announcement, DeviceProfile

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20


def _rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ rogue hosts for the coordinator


@contextlib.contextmanager
def _rogue(ca: TestCA, answer: Callable[[ssl.SSLSocket, threading.Event], None]) -> Iterator[int]:
    """A TLS server on 127.0.0.1 that reads a request head, then lets ``answer`` misbehave."""
    cert, key = ca.issue("rogue")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), ctx.wrap_socket(conn, server_side=True) as tls:
            tls.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    return
                head += chunk
            answer(tls, stop)

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _huge(tls: ssl.SSLSocket, stop: threading.Event) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 314572800\r\n\r\n")
    zeros = bytes(MiB)
    for _ in range(300):
        if stop.is_set():
            return
        tls.sendall(zeros)


def _endless(tls: ssl.SSLSocket, stop: threading.Event) -> None:
    tls.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    zeros = bytes(MiB)
    while not stop.is_set():
        tls.sendall(zeros)


def _drip(tls: ssl.SSLSocket, stop: threading.Event) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" * 100:
        if stop.wait(0.2):
            return
        tls.sendall(bytes([byte]))


def _announce(registry: DeviceRegistry, name: str, fingerprint: str, port: int) -> None:
    profile = DeviceProfile(
        device_id=fingerprint[:16],
        name=name,
        memory_bytes=1 << 30,
        gflops=1.0,
        control_port=port,
        data_port=port,
        cert_fingerprint=fingerprint,
    )
    announcement = Announcement(profile=profile, state=AgentState(paired=False))
    registry.announce(announcement, "127.0.0.1", f"{name}-svc")


def test_rogue_hosts_cost_the_coordinator_neither_memory_nor_other_pairings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_client, "PAIRING_TIMEOUT_S", 1.5)
    ca = TestCA(tmp_path / "ca")
    honest = start_agent(tmp_path, "honest", None, memory="64MiB")
    try:
        with _rogue(ca, _huge) as huge, _rogue(ca, _endless) as endless, _rogue(ca, _drip) as drip:
            before = _rss()
            for port, error in ((huge, "over the"), (endless, "over the"), (drip, "within")):
                with pytest.raises(AgentError, match=error):
                    fetch_offer(AgentAddress("rogue", "127.0.0.1", port))
            assert _rss() - before < 32 * MiB  # a 64 KiB cap, not 300 MiB

            state = tmp_path / "coordinator"
            authority = CertificateAuthority.open(state)
            pairing, registry = Pairing(state, authority), DeviceRegistry()
            agents = AgentClient(coordinator_context(open_identity(state, authority)))
            trust = TrustService(pairing, registry, authority, agents)
            for i, port in enumerate((huge, endless, drip)):
                _announce(registry, f"rogue{i}", f"{i}" * 64, port)
            offer = fetch_offer(AgentAddress("honest", "127.0.0.1", honest.control_port))
            csr = x509.load_pem_x509_csr(offer.csr_pem.encode())
            der = csr.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            _announce(registry, "honest", hashlib.sha256(der).hexdigest(), honest.control_port)
            trust.poll_once()  # one round: every exchange has its own deadline
            assert [p.name for p in pairing.book().pending] == ["honest"]
            assert _rss() - before < 64 * MiB
    finally:
        stop_agent(honest)


# ------------------------------------------------------------------------- the coordinator's API


def _raw_post(port: int, path: str, headers: str, body: bytes) -> bytes:
    """Send a request head and ``body`` (perhaps only part of what it declares); the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + body)
        answer = b""  # the rest of a declared body is never sent: the answer must not wait
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
        return answer


def test_the_api_refuses_unauthenticated_and_oversized_bodies_before_reading_them(
    tmp_path: Path,
) -> None:
    coordinator = start_coordinator(tmp_path)
    try:
        port = int(coordinator.url.rsplit(":", 1)[1])
        pid = coordinator.proc.pid
        with coordinator.client() as api:
            assert api.get("/v1/devices").status_code == 200
            before = _rss(pid)
            declared = "Content-Type: application/json\r\nContent-Length: 41943040\r\n"
            threads, answers = [], []
            for _ in range(4):  # four unauthenticated 40 MB bodies at once
                thread = threading.Thread(
                    target=lambda: answers.append(
                        _raw_post(port, "/v1/embeddings", declared, bytes(16 << 10))
                    )
                )
                thread.start()
                threads.append(thread)
            assert api.get("/v1/devices").status_code == 200  # served meanwhile
            for thread in threads:
                thread.join(60)
            assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 401 Unauthorized"] * 4
            token = f"Authorization: Bearer {coordinator.token}\r\n"
            big = _raw_post(
                port, "/v1/embeddings", token + declared.replace("41943040", "1e9"), b""
            )
            assert big.startswith(b"HTTP/1.1 400")
            over = "Content-Type: application/json\r\nContent-Length: 67108864\r\n"
            assert _raw_post(port, "/v1/embeddings", token + over, b"{").startswith(b"HTTP/1.1 413")
            chunked = "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            assert _raw_post(port, "/v1/embeddings", token + chunked, b"1\r\n{\r\n").startswith(
                b"HTTP/1.1 411"
            )
            url = f"{coordinator.url}/v1/devices?token={coordinator.token}"
            assert httpx.get(url, trust_env=False).status_code == 401  # the console's page only
            assert _rss(pid) - before < 48 * MiB  # not 4 x 40 MB, nor the 248 MB parsing took
            assert api.get("/v1/devices").status_code == 200
    finally:
        stop_process(coordinator.proc)


# ------------------------------------------------------------------------------------ the agents


def _agent_post(ctx: ssl.SSLContext, port: int, path: str, length: int) -> bytes:
    """A request head declaring ``length`` body bytes and no body; the agent's answer."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        head = f"POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n\r\n"
        tls.sendall(head.encode())
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        return answer


def test_agents_check_route_role_and_size_before_reading_a_body(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    agent = start_agent(tmp_path, "a0", ca, memory="64MiB")
    try:
        before = _rss(agent.proc.pid)
        as_agent = ca.client_context("a1", ROLE_AGENT)
        as_coordinator = ca.client_context("coordinator")
        for ctx in (as_agent, as_coordinator):
            ctx.check_hostname = False
        port = agent.control_port
        assert _agent_post(as_agent, port, "/v1/deploy", 2 << 30).startswith(b"HTTP/1.1 403")
        assert _agent_post(as_coordinator, port, "/v1/nothing", 2 << 30).startswith(b"HTTP/1.1 404")
        refused = _agent_post(as_coordinator, port, "/v1/revocations", 100 * MiB)
        assert refused.startswith(b"HTTP/1.1 413") and b"this route" in refused
        assert _rss(agent.proc.pid) - before < 16 * MiB
        with control_client(ca) as client:  # the coordinator keeps being served
            assert client.get(agent.url("/v1/status")).json()["paired"] is True
    finally:
        stop_agent(agent)


def test_an_idle_control_connection_is_answered_408_and_closed(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    identity = tls_identity(ca, "a0", tmp_path)

    async def status(body: bytes) -> Response:
        return Response(200, b"{}")

    server = ControlServer({("GET", "/v1/status"): Route(status, None)}, MiB, head_timeout_s=0.5)

    async def main() -> tuple[bytes, bytes]:
        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.handle(reader, writer, Peer("x", ROLE_AGENT))
            writer.close()

        listener = await asyncio.start_server(
            on_connection, "127.0.0.1", 0, ssl=server_context(identity)
        )
        port = listener.sockets[0].getsockname()[1]
        ctx = client_context(tls_identity(ca, "c", tmp_path))
        try:
            idle_reader, _ = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            writer.write(b"GET /v1/status HTTP/1.1\r\nHost: a\r\n\r\n")
            served = await asyncio.wait_for(reader.read(), 10)  # another caller is served
            idle = await asyncio.wait_for(idle_reader.read(), 10)  # then the server closes it
            return served, idle
        finally:
            listener.close()

    served, idle = asyncio.run(main())
    assert served.startswith(b"HTTP/1.1 200")
    assert idle.startswith(b"HTTP/1.1 408")


async def _send_and_wait(port: int, ctx: ssl.SSLContext, frame: bytes, received: list[str]) -> None:
    """Send one whole frame on a new connection; wait (5 s at most) until something arrived."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    writer.write(frame)
    await writer.drain()
    for _ in range(100):
        if received:
            break
        await asyncio.sleep(0.05)
    writer.close()


def test_unfinished_frames_share_one_bounded_budget(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    receiver, sender = tls_identity(ca, "a1", tmp_path), tls_identity(ca, "a0", tmp_path)
    received: list[str] = []
    big = encode_frame(FrameHeader(request_id="big"), {"t": np.zeros(2 * MiB, np.float32)})
    small = encode_frame(FrameHeader(request_id="small"), {"t": np.ones(4, np.float32)})

    async def main() -> tuple[int, list[bool]]:
        server = FrameServer(
            request_id_recorder(received),
            server_context(receiver),
            16 * MiB,
            max_unfinished_bytes=len(big) * 2,
        )
        port = await server.start("127.0.0.1", 0)
        ctx = client_context(sender)
        parked = []
        try:
            for _ in range(4):  # each starts a large frame and never finishes it
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                writer.write(big[:MiB])
                await writer.drain()
                parked.append((reader, writer))
            await asyncio.sleep(0.5)
            reserved = server._budget.used
            cut = []
            for reader, _ in parked:
                try:
                    cut.append(await asyncio.wait_for(reader.read(1), 0.5) == b"")
                except TimeoutError:
                    cut.append(False)
            await _send_and_wait(port, ctx, small, received)
            return reserved, cut
        finally:
            for _, writer in parked:
                writer.close()
            await server.close()

    reserved, cut = asyncio.run(main())
    assert reserved == 2 * len(big)  # two unfinished frames fit; the others were refused
    assert cut.count(True) == 2 and cut.count(False) == 2
    assert received == ["small"]  # an honest peer is still served


def test_one_peer_cannot_take_the_whole_frame_allowance(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    receiver = tls_identity(ca, "a1", tmp_path)
    greedy, other = tls_identity(ca, "a0", tmp_path), tls_identity(ca, "a2", tmp_path / "a2")
    received: list[str] = []
    big = encode_frame(FrameHeader(request_id="big"), {"t": np.zeros(2 * MiB, np.float32)})
    small = encode_frame(FrameHeader(request_id="small"), {"t": np.ones(4, np.float32)})

    async def park(port: int, ctx: ssl.SSLContext) -> tuple[asyncio.StreamReader, object]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        writer.write(big[:MiB])  # starts a large frame and never finishes it
        await writer.drain()
        return reader, writer

    async def cut(reader: asyncio.StreamReader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(1), 0.5) == b""
        except TimeoutError:
            return False

    async def main() -> tuple[list[int], list[bool], bool]:
        server = FrameServer(
            request_id_recorder(received),
            server_context(receiver),
            16 * MiB,
            max_unfinished_bytes=len(big) * 4,
            max_unfinished_per_peer=len(big) * 2,
        )
        port = await server.start("127.0.0.1", 0)
        parked = []
        try:
            for _ in range(4):
                parked.append(await park(port, client_context(greedy)))
            await asyncio.sleep(0.5)
            held = [server._budget.used, server._budget.held_by("a0")]
            greedy_cut = [await cut(reader) for reader, _ in parked]
            # another peer still gets a share: its large frame is reserved, not refused
            parked.append(await park(port, client_context(other)))
            await asyncio.sleep(0.5)
            held.append(server._budget.held_by("a2"))
            other_cut = await cut(parked[-1][0])
            # a whole small frame reserves nothing: the greedy peer's too is served
            await _send_and_wait(port, client_context(greedy), small, received)
            return held, greedy_cut, other_cut
        finally:
            for _, writer in parked:
                writer.close()  # type: ignore[attr-defined]
            await server.close()

    held, greedy_cut, other_cut = asyncio.run(main())
    assert held == [2 * len(big), 2 * len(big), len(big)]  # a0 stopped at its half
    assert greedy_cut.count(True) == 2 and not other_cut
    assert received == ["small"]
