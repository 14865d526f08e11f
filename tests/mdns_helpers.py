"""mDNS advertisers for tests: a separate process that announces one ``_fedshard._tcp`` service
on 127.0.0.1 with real zeroconf, as an agent would, until its stdin closes.

The ``advertise`` fixture (``tests/conftest.py``) starts them and kills what a test left;
:func:`stop_advertiser` withdraws one the way an agent that stops does.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

ADVERTISER = textwrap.dedent(
    """
    import socket, sys, time
    from zeroconf import IPVersion, ServiceInfo, Zeroconf
    name, port, txt = sys.argv[1], int(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    info = ServiceInfo("_fedshard._tcp.local.", f"{name}._fedshard._tcp.local.",
                       addresses=[socket.inet_aton("127.0.0.1")], port=port, properties=txt)
    zc.register_service(info)
    print("up", flush=True)
    try:
        sys.stdin.read()
    finally:
        zc.unregister_service(info)
        zc.close()
    """
)


def start_advertiser(
    service: str, port: int, txt: dict[str, str], started: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    """Announce ``service`` on ``port`` with ``txt``; returns once it is registered. The process
    joins ``started`` first, so that it is stopped even when it never comes up."""
    args = [f"{k}={v}" for k, v in txt.items()]
    proc = subprocess.Popen(
        [sys.executable, "-c", ADVERTISER, service, str(port), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


def stop_advertiser(proc: subprocess.Popen[str]) -> None:
    """Withdraw the service (the advertiser unregisters it) and wait for the process."""
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)
