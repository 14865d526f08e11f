"""The hostile side of ``bench/soak.py``: a rogue on mDNS, a dripping client and unauthenticated
floods. Each runs in a thread until told to stop and counts what it saw, so the soak can report
every refusal by its status. (Resident memory over time: ``bench/_soak_memory.py``.)"""

from __future__ import annotations

import asyncio
import collections
import secrets
import socket
import threading
from dataclasses import dataclass, field

import httpx

from edge_agent.net.discovery import ZeroconfAdvertiser
from protocols.profile import AgentState, Announcement, DeviceProfile

MiB = 1 << 20
FLOOD_BYTES = 4 << 20
DRIP_INTERVAL_S = 1.0


@dataclass
class Seen:
    """Outcomes by kind, shared by the hostile threads."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str) -> None:
        """Count one outcome."""
        with self.lock:
            self.counts[what] += 1


def rogue_announcer(names: list[str], fingerprint: str, stop: threading.Event, seen: Seen) -> None:
    """Announce fakes over mDNS on 127.0.0.1 until ``stop``: one agent named like each paired
    device with a made-up fingerprint, and one copying a paired device's fingerprint."""

    async def main() -> None:
        fakes = [_fake(name, secrets.token_hex(32)) for name in names]
        fakes.append(_fake(f"copy-{secrets.token_hex(2)}", fingerprint))
        advertisers = [ZeroconfAdvertiser("127.0.0.1") for _ in fakes]
        for advertiser, fake in zip(advertisers, fakes, strict=True):
            await advertiser.start(fake)
            seen.add("rogue announcements")
        while not stop.is_set():
            await asyncio.sleep(2.0)
        for advertiser in advertisers:
            await advertiser.close()

    asyncio.run(main())


def _fake(name: str, fingerprint: str) -> Announcement:
    port = 1 + secrets.randbelow(60000)
    return Announcement(
        profile=DeviceProfile(
            device_id=secrets.token_hex(16),
            name=name,
            memory_bytes=8 << 30,
            gflops=1000.0,
            control_port=port,
            data_port=port + 1,
            cert_fingerprint=fingerprint,
        ),
        state=AgentState(paired=True),
    )


def dripper(port: int, stop: threading.Event, seen: Seen) -> None:
    """Open a connection to the API and send a request one byte a second, again and again;
    counts how each connection ended (the status, or ``closed``)."""
    request = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            seen.add(_drip_one(sock, request, stop))


def _drip_one(sock: socket.socket, request: bytes, stop: threading.Event) -> str:
    sock.settimeout(DRIP_INTERVAL_S)
    for byte in request * 100:
        if stop.is_set():
            return "stopped"
        try:
            sock.sendall(bytes([byte]))
            answer = sock.recv(256)
        except TimeoutError:
            continue
        except OSError:
            return "drip: connection reset"
        return f"drip: {_status(answer)}"
    return "drip: never answered"


def _status(answer: bytes) -> str:
    if not answer:
        return "closed"
    parts = answer.split(b" ", 2)
    return parts[1].decode(errors="replace") if len(parts) > 1 else "closed"


def flooder(url: str, path: str, stop: threading.Event, seen: Seen, pause_s: float = 0.0) -> None:
    """POST :data:`FLOOD_BYTES` bodies without a token until ``stop``, ``pause_s`` apart;
    counts the statuses. (The typed client never sends such a request: raw httpx.)"""
    body = b"x" * FLOOD_BYTES
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        while not stop.wait(pause_s):
            try:
                status = str(client.post(path, content=body, headers=headers).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            seen.add(f"unauthenticated {FLOOD_BYTES // MiB} MiB body: {status}")
