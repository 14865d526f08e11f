"""Small network probes run *inside* lab namespaces (``python -m devtools.lab.probe ...``).

Each prints one JSON line on stdout, so tests, benchmarks and ``lab up`` can read the result:

- ``echo-server --bind ADDR --port P``: echoes lines until killed (prints ``{"ready": ...}``);
- ``connect --to ADDR:P [--to ...]``: one echo round trip over TCP to each target;
- ``sink --bind ADDR --port P``: receives one bulk TCP stream, reports bytes and Mbit/s from the
  first to the last byte received;
- ``send --to ADDR:P --seconds S``: sends a bulk TCP stream for ``S`` seconds;
- ``browse --interface ADDR --expect N``: the coordinator's mDNS browser
  (:class:`coordinator.fleet.discovery.ZeroconfDiscovery`) until ``N`` agents are seen.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Sequence

CHUNK = 64 * 1024


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _listen(bind: str, port: int) -> socket.socket:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((bind, port))
    server.listen(16)
    return server


def echo_server(bind: str, port: int) -> int:
    """Echo every line back, one thread per connection, until killed."""
    server = _listen(bind, port)
    _emit({"ready": f"{bind}:{server.getsockname()[1]}"})

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as stream:
            for line in stream:
                stream.write(line)
                stream.flush()

    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def connect(targets: Sequence[str], timeout_s: float) -> int:
    """One echo round trip to each target; exit 0 if every echo came back intact."""
    results = [_round_trip(to, timeout_s) for to in targets]
    _emit(results)
    return 0 if all(r["ok"] for r in results) else 1


def _round_trip(to: str, timeout_s: float) -> dict[str, object]:
    start = time.perf_counter()
    try:
        with socket.create_connection(_endpoint(to), timeout=timeout_s) as conn:
            local = conn.getsockname()[0]
            conn.sendall(b"ping\n")
            reply = conn.makefile("rb").readline()
    except OSError as exc:
        return {"ok": False, "to": to, "error": f"{type(exc).__name__}: {exc}"}
    rtt_ms = (time.perf_counter() - start) * 1e3
    return {"ok": reply == b"ping\n", "to": to, "from": local, "rtt_ms": rtt_ms}


def sink(bind: str, port: int, timeout_s: float) -> int:
    """Receive one stream; report its rate between the first and the last byte."""
    server = _listen(bind, port)
    server.settimeout(timeout_s)
    _emit({"ready": f"{bind}:{server.getsockname()[1]}"})
    conn, peer = server.accept()
    conn.settimeout(timeout_s)
    total, first, last = 0, 0.0, 0.0
    with conn:
        buf = bytearray(CHUNK)
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            last = time.perf_counter()
            if total == 0:
                first = last
            total += n
    seconds = last - first
    mbps = total * 8 / seconds / 1e6 if seconds > 0 else 0.0
    _emit({"bytes": total, "seconds": seconds, "mbps": mbps, "peer": peer[0]})
    return 0


def send(to: str, seconds: float) -> int:
    """Send zeros as fast as the link allows for ``seconds``."""
    payload = bytes(CHUNK)
    total = 0
    with socket.create_connection(_endpoint(to), timeout=30) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)
            total += len(payload)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
    _emit({"sent": total})
    return 0


def browse(interface: str, expect: int, timeout_s: float) -> int:
    """Browse for agents; print them once ``expect`` are online (exit 1 on timeout)."""
    from coordinator.fleet.discovery import ZeroconfDiscovery
    from coordinator.fleet.registry import DeviceRegistry

    registry = DeviceRegistry()
    with ZeroconfDiscovery(registry, interface):
        found = registry.wait_for(lambda devices: len(devices) >= expect, timeout_s)
        devices = [
            {
                "name": r.name,
                "host": r.host,
                "control_port": r.announcement.profile.control_port,
                "memory_bytes": r.announcement.profile.memory_bytes,
                "fingerprint": r.fingerprint,
            }
            for r in registry.devices()
        ]
    _emit({"found": found, "devices": devices})
    return 0 if found else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m devtools.lab.probe``."""
    parser = argparse.ArgumentParser(prog="python -m devtools.lab.probe")
    sub = parser.add_subparsers(dest="probe", required=True)
    for name in ("echo-server", "sink"):
        p = sub.add_parser(name)
        p.add_argument("--bind", required=True)
        p.add_argument("--port", type=int, default=0)
        p.add_argument("--timeout", type=float, default=30.0)
    p = sub.add_parser("connect")
    p.add_argument("--to", required=True, action="append", help="ADDR:PORT (repeatable)")
    p.add_argument("--timeout", type=float, default=5.0)
    p = sub.add_parser("send")
    p.add_argument("--to", required=True)
    p.add_argument("--seconds", type=float, default=2.0)
    p = sub.add_parser("browse")
    p.add_argument("--interface", required=True)
    p.add_argument("--expect", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.probe == "echo-server":
        return echo_server(args.bind, args.port)
    if args.probe == "sink":
        return sink(args.bind, args.port, args.timeout)
    if args.probe == "connect":
        return connect(args.to, args.timeout)
    if args.probe == "send":
        return send(args.to, args.seconds)
    return browse(args.interface, args.expect, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
