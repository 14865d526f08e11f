"""Hostile LAN, second round: slow and many connections on the coordinator's HTTP port.

1,500 half-sent request heads stayed open on the coordinator for 40 s and more. The API's server
(:func:`coordinator.http.server.api_server`) now answers a head not complete within its deadline
with 408 and closes, caps what an incomplete head may hold, and caps open connections per
source, while a well-behaved client keeps being answered. In process, on 127.0.0.1, with the
deadline and caps shrunk so the test stays short.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from coordinator.http import server as server_module
from coordinator.http.server import api_server

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _serving() -> Iterator[int]:
    app = FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, str]:
        return {"ok": "yes"}

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = api_server(app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _answered(port: int) -> bool:
    return bool(httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).json() == {"ok": "yes"})


def _until_closed(sock: socket.socket, within: float) -> bytes:
    """Everything the server sends until it closes, or raises if it is still open after."""
    sock.settimeout(within)
    received = b""
    with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
        while chunk := sock.recv(4096):
            received += chunk
    return received


def test_half_sent_heads_get_408_and_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "HEAD_DEADLINE_S", 1.0)
    with _serving() as port:
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        try:
            for sock in slow:
                sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
            for _ in range(3):  # a byte at a time: each arrives inside any per-read timeout
                time.sleep(0.2)
                for sock in slow:
                    sock.sendall(b"X")
            assert _answered(port)  # a good client is served meanwhile
            answers = [_until_closed(sock, 5.0) for sock in slow]
        finally:
            for sock in slow:
                sock.close()
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[:2]
        # a connection that has been served waits for its next head under the same deadline
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.sendall(b"GET /ping HTTP/1.1\r\n")  # the next head, never finished
            answer = _until_closed(sock, 8.0)
        assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in answer
        assert _answered(port)


def test_connections_beyond_the_per_source_cap_are_closed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "MAX_PER_SOURCE", 8)
    monkeypatch.setattr(server_module, "HEAD_DEADLINE_S", 30.0)  # only the cap closes them
    with _serving() as port:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        try:
            time.sleep(0.3)  # accepted and counted
            extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
            assert [_until_closed(sock, 5.0) for sock in extra] == [b""] * 4
            for sock in extra:
                sock.close()
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.3)  # the idle ones are uncounted when they close
        assert _answered(port)


def test_an_oversized_incomplete_head_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "HEAD_DEADLINE_S", 30.0)
    with _serving() as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(OSError):  # the server may close while we still send
            for i in range(100):
                sock.sendall(f"X-Pad-{i}: {'p' * 1000}\r\n".encode())
        answer = _until_closed(sock, 5.0)
        assert answer.startswith((b"HTTP/1.1 4", b"")), answer[:80]
        assert not answer.startswith(b"HTTP/1.1 2")
        assert _answered(port)
