"""Hostile LAN, second round: many small bodies no longer add up on an agent.

200 concurrent unauthenticated 1 MiB ``POST /v1/pairing`` bodies took an unpaired
``--memory 256MiB`` agent from 124 MB to a 412 MB peak (still 436 MB a minute later): each body
was capped, their number was not. Now the agent's control plane caps open connections (in all
and per source) and the bytes of bodies being read at once, all from ``--memory``
(:mod:`edge_agent.net.budgets`): the flood gets refusals, the agent stays inside its budget and
keeps answering. A real agent process on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from agent_helpers import start_agent, stop_agent
from coordinator_helpers import wait_for

from edge_agent.net.budgets import (
    ConnectionLimits,
    connection_caps,
    control_body_budget,
    frame_allowance,
    frame_allowance_per_peer,
)

pytestmark = pytest.mark.timeout(180)
MiB = 1 << 20
FLOOD = 200


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {key}")


def _post_body(port: int) -> str:
    """One unauthenticated 1 MiB pairing body; what came back (a status line, or how it ended)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=60) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            head = f"POST /v1/pairing HTTP/1.1\r\nHost: x\r\nContent-Length: {MiB}\r\n\r\n"
            tls.sendall(head.encode())
            with contextlib.suppress(OSError):  # a refused body is not read: sending may fail
                tls.sendall(b"{" + b" " * (MiB - 2) + b"}")
            answer = tls.recv(64)
            return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    except (OSError, ssl.SSLError) as exc:
        return f"refused: {type(exc).__name__}"


def test_a_flood_of_pairing_bodies_stays_inside_the_agents_budget(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "flooded", None, memory="256MiB")
    pid = agent.proc.pid
    try:
        with httpx.Client(verify=False, trust_env=False) as anon:
            assert anon.get(agent.url("/v1/pairing")).status_code == 200
        # the peak so far is the start's (the profile measured without a cached profile.json
        # peaks well above the steady state): reset it, so that the peak below is the flood's
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        before = _status_kib(pid, "VmRSS")
        with ThreadPoolExecutor(FLOOD) as pool:
            answers = list(pool.map(lambda _: _post_body(agent.control_port), range(FLOOD)))
        peak = _status_kib(pid, "VmHWM")
        busy = sum(a.startswith("HTTP/1.1 503") for a in answers)
        refused = sum(not a.startswith("HTTP/1.1") for a in answers)
        growth_mib = (peak - before) / 1024
        after = _status_kib(pid, "VmRSS")
        print(
            f"RSS before {before / 1024:.0f} MiB, peak +{growth_mib:.0f} MiB, "
            f"after +{(after - before) / 1024:.0f} MiB; "
            f"{busy} answered 503, {refused} refused, {FLOOD - busy - refused} answered"
        )
        # the caps engaged: bodies beyond the budget were answered 503 without being read, and
        # connections beyond the caps closed before their handshake
        assert busy > 0 and refused > 0, answers[:5]
        # bodies in flight (32 MiB) plus TLS connections and parsing; was +288 MB
        assert growth_mib < 128, f"peak grew by {growth_mib:.0f} MiB"
        # and the memory returns once the burst is over (the heap is trimmed; was +436 MB)
        assert wait_for(lambda: _status_kib(pid, "VmRSS") - before < 48 * 1024, 10.0)
        with httpx.Client(verify=False, trust_env=False) as anon:  # still answering
            assert anon.get(agent.url("/v1/pairing")).status_code == 200
    finally:
        stop_agent(agent)


def test_the_budgets_follow_memory() -> None:
    # the data-plane frame allowance was 2 x 256 MiB whatever --memory said
    assert frame_allowance(1 << 30, 256 * MiB) == 256 * MiB
    assert frame_allowance(256 * MiB, 256 * MiB) == 64 * MiB
    assert frame_allowance(64 << 30, 256 * MiB) == 512 * MiB
    assert frame_allowance_per_peer(frame_allowance(256 * MiB, 256 * MiB)) == 32 * MiB
    assert control_body_budget(256 * MiB) == 32 * MiB
    assert connection_caps(256 * MiB) == (128, 64)
    limits = ConnectionLimits(total=3, per_source=2)
    a1, a2 = limits.admit(("10.0.0.1", 1)), limits.admit(("10.0.0.1", 2))
    assert (a1, a2) == ("10.0.0.1", "10.0.0.1")
    assert limits.admit(("10.0.0.1", 3)) is None  # per source
    assert limits.admit(("10.0.0.2", 1)) == "10.0.0.2"
    assert limits.admit(("10.0.0.3", 1)) is None  # in all
    limits.release("10.0.0.1")
    assert limits.admit(("10.0.0.3", 1)) == "10.0.0.3"
    assert (limits.open(), limits.refused) == (3, 2)
