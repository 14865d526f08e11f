"""Hostile LAN, second round: hosts that drip their answers delay nobody else's pairing.

Round one gave every offer fetch its own deadline, but a poll round still waited for its whole
batch before recording offers, delivering grants or pushing revocations: 24 announcements
pointing at a server that drips a byte every 2 s delayed a real agent's pending state to 17.7 s.
Now each exchange is its own tracked task (:mod:`coordinator.trust.exchanges`), handled as it
completes, and an endpoint that drips or fails backs off.
"""

from __future__ import annotations

import contextlib
import hashlib
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import start_agent, stop_agent
from coordinator_helpers import wait_for
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from coordinator.config import Retries
from coordinator.errors import AgentError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.transport.agent_client import AgentAddress, AgentClient, fetch_offer
from coordinator.transport.tls import client_context
from coordinator.trust import delivery
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.delivery import TrustService
from coordinator.trust.exchanges import Exchanges
from coordinator.trust.identity import open_identity
from coordinator.trust.pairing import Pairing
from protocols.pairing import CODE_FILE
from protocols.profile import AgentState, Announcement, DeviceProfile

pytestmark = pytest.mark.timeout(120)
ROGUES = 24
DRIP_S = 2.0


@contextlib.contextmanager
def _dripping_server(ports: int) -> Iterator[tuple[list[int], list[socket.socket]]]:
    """``ports`` listeners on 127.0.0.1; every connection gets one byte every 2 s, forever."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(ports)]
    selector = selectors.DefaultSelector()
    for listener in listeners:
        listener.setblocking(False)
        selector.register(listener, selectors.EVENT_READ)
    stop = threading.Event()
    connections: list[socket.socket] = []

    def serve() -> None:
        next_drip = time.monotonic() + DRIP_S
        while not stop.is_set():
            for key, _ in selector.select(timeout=max(0.0, next_drip - time.monotonic())):
                with contextlib.suppress(BlockingIOError):
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    connections.append(conn)
            if time.monotonic() < next_drip:
                continue
            next_drip += DRIP_S
            for conn in list(connections):
                try:
                    conn.send(b"\x16")  # a TLS handshake record's first byte, and no more
                except OSError:
                    connections.remove(conn)
                    conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield [listener.getsockname()[1] for listener in listeners], connections
    finally:
        stop.set()
        thread.join(5)
        for sock in [*connections, *listeners]:
            sock.close()
        selector.close()


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
    registry.announce(
        Announcement(profile=profile, state=AgentState(paired=False)), "127.0.0.1", f"{name}-svc"
    )


def test_dripping_announcements_delay_no_real_agents_pairing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def fetch(agent: AgentAddress):  # type: ignore[no-untyped-def]
        try:
            offer = fetch_offer(agent)
        except AgentError:
            with lock:
                events.append(("failed", agent.device))
            raise
        with lock:
            events.append(("offer", agent.device))
        return offer

    monkeypatch.setattr(delivery, "fetch_offer", fetch)
    honest = start_agent(tmp_path, "honest", None, memory="64MiB")
    state = tmp_path / "coordinator"
    authority = CertificateAuthority.open(state)
    pairing, registry = Pairing(state, authority), DeviceRegistry()
    agents = AgentClient(client_context(open_identity(state, authority)))
    trust = TrustService(pairing, registry, authority, agents)
    try:
        with _dripping_server(ROGUES) as (ports, dripping):
            for i, port in enumerate(ports):
                _announce(registry, f"rogue{i}", f"{i:02d}" * 32, port)
            trust.start()
            # the rogues' fetches are under way, each dripping toward its 5 s deadline
            assert wait_for(lambda: len(dripping) >= ROGUES // 3, 5.0)
            offer = fetch_offer(AgentAddress("honest", "127.0.0.1", honest.control_port))
            csr = x509.load_pem_x509_csr(offer.csr_pem.encode())
            der = csr.public_key().public_bytes(
                serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            _announce(registry, "honest", hashlib.sha256(der).hexdigest(), honest.control_port)
            assert wait_for(lambda: [p.name for p in pairing.book().pending] == ["honest"], 2.0)
            with lock:
                assert events == [("offer", "honest")], "the honest offer waited for a drip"
            assert len(dripping) == ROGUES  # every rogue is being asked at once, each on its own
            # approving delivers the grant while the rogues still drip
            code = (honest.state_dir / CODE_FILE).read_text().strip()
            device = trust.approve("honest", code)
            assert device.name == "honest"
            with lock:
                assert not any(kind == "failed" for kind, _ in events)
            # every drip ends at its deadline, and the endpoint backs off: asked once, not again
            assert wait_for(lambda: len(events) == 1 + ROGUES, 15.0)
            with lock:
                failed = sorted(name for kind, name in events if kind == "failed")
            assert failed == sorted(f"rogue{i}" for i in range(ROGUES))
    finally:
        trust.stop()
        stop_agent(honest)
    assert trust.in_flight() == 0  # stop ended every exchange


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_endpoint_that_fails_backs_off_doubling_and_an_answer_resets_it() -> None:
    clock = Clock()
    pool = Exchanges(clock)
    endpoint = ("127.0.0.1", 9)
    results: list[object] = []
    gate = threading.Event()

    def failing() -> None:
        gate.wait(5)
        raise AgentError("dripped past its deadline")

    try:
        assert pool.start(endpoint, failing, results.append)
        assert not pool.start(endpoint, lambda: None, results.append)  # one at a time
        assert pool.start(("127.0.0.1", 10), lambda: "other", results.append)  # others go on
        gate.set()
        assert pool.wait_idle(5.0)
        assert not pool.ready(endpoint)
        clock.now += Retries().exchange_retry_s
        assert pool.start(endpoint, failing, results.append)
        assert pool.wait_idle(5.0)
        clock.now += Retries().exchange_retry_s
        assert not pool.ready(endpoint)  # the second failure in a row doubled it
        clock.now += Retries().exchange_retry_s
        assert pool.start(endpoint, lambda: "answer", results.append)
        assert pool.wait_idle(5.0)
        assert pool.ready(endpoint)  # an answer resets the backoff
    finally:
        pool.close()
    assert "other" in results and "answer" in results
    assert sum(isinstance(r, AgentError) for r in results) == 2
