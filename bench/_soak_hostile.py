"""The hostile side of ``bench/soak.py``: a rogue on mDNS, a dripping client, unauthenticated
floods, and the resident-memory sampler with its plot. Each runs in a thread until told to stop
and counts what it saw, so the soak can report every refusal by its status."""

from __future__ import annotations

import asyncio
import collections
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

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


def flooder(url: str, path: str, stop: threading.Event, seen: Seen) -> None:
    """POST :data:`FLOOD_BYTES` bodies without a token until ``stop``; counts the statuses."""
    body = b"x" * FLOOD_BYTES
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        while not stop.is_set():
            try:
                status = str(client.post(path, content=body, headers=headers).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            seen.add(f"unauthenticated {FLOOD_BYTES // MiB} MiB body: {status}")


@dataclass
class MemoryLog:
    """Resident memory of every process over time: (seconds since start, bytes) by name."""

    started: float = field(default_factory=time.monotonic)
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def sample(self, pids: dict[str, int]) -> None:
        """One sample of each process still running."""
        now = time.monotonic() - self.started
        for name, pid in pids.items():
            try:
                rss = int(psutil.Process(pid).memory_info().rss)
            except psutil.Error:
                continue
            self.samples.setdefault(name, []).append((now, rss))

    def peak(self, name: str) -> int:
        """The largest resident set seen for ``name``."""
        return max(rss for _, rss in self.samples.get(name, [(0.0, 0)]))


def sampler(pids: Callable[[], dict[str, int]], log: MemoryLog, stop: threading.Event) -> None:
    """Sample every second until ``stop``."""
    while not stop.wait(1.0):
        log.sample(pids())


def plot_memory(
    log: MemoryLog, budgets: dict[str, int], events: dict[str, float], out: Path
) -> bool:
    """Resident memory against budget over time as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    for name, points in sorted(log.samples.items()):
        line = ax.plot([t for t, _ in points], [r / MiB for _, r in points], label=name)[0]
        if name in budgets:
            ax.axhline(budgets[name] / MiB, color=line.get_color(), linestyle=":", linewidth=1)
    for label, at in events.items():
        ax.axvline(at, color="grey", linestyle="--", linewidth=1)
        ax.text(at, ax.get_ylim()[1] * 0.97, label, rotation=90, va="top", fontsize=8)
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("resident MiB (dotted: the agent's --memory budget)")
    ax.set_title("Resident memory of every process under hostile load")
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
