"""The LAN half of ``bench/handoff.py``: the same hand-off round trips between two lab hosts.

Each link rate gets its own lab (``devtools.lab.Lab``: two network namespaces on a bridge,
``tbf`` on both hosts' links, both directions). Inside ``h1`` run the servers, bound to h1's lab
address: a real ``fedshard agent`` (TLS data plane), the plain-TCP frame echo and the raw
blocking-socket echoes of ``handoff.py``. Inside ``h0`` a client process (``handoff.py
--lab-client``) runs the same interleaved measurement as the loopback bench and writes its rows
as JSON. Every process has a deadline; the lab, its namespaces and whatever runs in them are
removed when the ``with Lab`` block ends, failure or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from coordinator_helpers import stop_process

from devtools.lab.executor import unavailable_reason
from devtools.lab.lab import Lab
from devtools.lab.spec import LabSpec

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "handoff.py"
START_TIMEOUT_S = 60.0


def lab_unavailable() -> str:
    """Why the lab cannot run here ('' when it can)."""
    return unavailable_reason()


def lab_sizes(sizes: list[tuple[int, str, int]], rate_mbps: float) -> list[tuple[int, str, int]]:
    """Fewer repeats on slow links: a 16 MiB round trip takes ~1.4 s at 100 Mbit/s."""
    factor = min(1.0, max(0.3, rate_mbps / 1000))
    return [(size, label, max(5, int(n * factor))) for size, label, n in sizes]


def client_timeout_s(sizes: list[tuple[int, str, int]], rate_mbps: float, scale: float) -> float:
    """A generous bound on the client's run: every round trip at a tenth of the link rate."""
    total = 0.0
    for size, _, n in sizes:
        rounds = 4 * (max(5, int(n * scale)) + 3)
        total += rounds * size * 8 / (rate_mbps * 1e6) * 10
    return 60.0 + total


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[Any]], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not all(p.exists() for p in paths):
        dead = [p.args for p in procs if p.poll() is not None]  # argv lists
        if dead:
            raise RuntimeError(f"{what}: a server exited early: {dead[0]!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: servers not ready in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def measure_rate(
    rate_mbps: float,
    work: Path,
    ca: Any,
    sizes: list[tuple[int, str, int]],
    scale: float,
) -> list[dict[str, Any]]:
    """One lab with both hosts shaped to ``rate_mbps``; the client's rows."""
    work.mkdir(parents=True, exist_ok=True)
    spec = LabSpec.build(2, bandwidth_mbps=f"{rate_mbps:g},{rate_mbps:g}", agents=False)
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with Lab(spec, work / "lab") as lab:
        h0, h1 = lab.plan.hosts
        procs: list[subprocess.Popen[Any]] = []
        logs: list[IO[str]] = []

        def start(name: str, argv: list[str]) -> subprocess.Popen[Any]:
            log = (work / f"{name}.log").open("w")
            logs.append(log)
            proc = lab.popen(h1.name, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            procs.append(proc)
            return proc

        try:
            state = work / "agent"
            state.mkdir(exist_ok=True)
            cert, key = ca.issue("hop")
            agent = [py, "-m", "edge_agent", "agent", "--name", "hop", "--memory", "256MiB"]
            agent += ["--state-dir", str(state), "--interface", h1.address, "--no-advertise"]
            agent += ["--max-frame", "64MiB", "--ca", str(ca.ca_path), "--threads", "1"]
            agent += ["--cert", str(cert), "--key", str(key)]
            start("agent", agent)
            tcp_file, raw_file = work / "tcp.port", work / "raw.port"
            start("tcp", [py, str(SCRIPT), "--serve-tcp", str(tcp_file), "--bind", h1.address])
            raw = [py, str(SCRIPT), "--serve-raw", str(raw_file), str(ca.directory)]
            start("raw", [*raw, "--bind", h1.address])
            _wait_for([state / "agent.json", tcp_file, raw_file], procs, f"{rate_mbps:g} Mbit/s")
            bench_cert, bench_key = ca.issue("bench", "coordinator")
            config = {
                "host": h1.address,
                "tls_port": json.loads((state / "agent.json").read_text())["data_port"],
                "tcp_port": int(tcp_file.read_text()),
                "raw_ports": [int(x) for x in raw_file.read_text().split()],
                "ca": str(ca.ca_path),
                "cert": str(bench_cert),
                "key": str(bench_key),
                "scale": scale,
                "sizes": sizes,
                "out": str(work / "rows.json"),
            }
            (work / "client.json").write_text(json.dumps(config))
            timeout = client_timeout_s(sizes, rate_mbps, scale)
            client = lab.exec_argv(
                h0.name, [py, str(SCRIPT), "--lab-client", str(work / "client.json")]
            )
            done = subprocess.run(
                client, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
            if done.returncode != 0:
                raise RuntimeError(f"lab client failed ({done.returncode}):\n{done.stderr[-3000:]}")
            rows: list[dict[str, Any]] = json.loads((work / "rows.json").read_text())
        finally:
            for proc in procs:
                stop_process(proc, 10.0)
            for log in logs:
                log.close()
    for row in rows:
        row["rate_mbps"] = rate_mbps
    return rows


def run_lab(
    rates: list[float], work: Path, ca: Any, sizes: list[tuple[int, str, int]], scale: float
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for rate in rates:
        rows += measure_rate(rate, work / f"lab-{rate:g}", ca, lab_sizes(sizes, rate), scale)
    return rows


COLUMNS = (
    "link",
    "size",
    "TLS ms",
    "TCP ms",
    "TLS/TCP",
    "raw TLS ms",
    "raw TCP ms",
    "raw TLS/TCP",
    "TLS Gbit/s",
    "TCP Gbit/s",
    "n",
)


def cells(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['rate_mbps']:g} Mbit/s",
        str(row["label"]),
        f"{row['tls_ms']:.3f}",
        f"{row['tcp_ms']:.3f}",
        f"{row['tls_over_tcp']:.2f}x",
        f"{row['raw_tls_ms']:.3f}",
        f"{row['raw_tcp_ms']:.3f}",
        f"{row['raw_ratio']:.2f}x",
        f"{row['tls_gbps']:.3f}",
        f"{row['tcp_gbps']:.3f}",
        str(int(row["n"])),
    ]


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Per link rate: the 1.3x target for >= 1 MiB, for our data plane and raw sockets."""
    out = []
    for rate in dict.fromkeys(r["rate_mbps"] for r in rows):
        big = [r for r in rows if r["rate_mbps"] == rate and r["size"] >= 1 << 20]
        ok = all(r["tls_over_tcp"] <= 1.3 for r in big)
        floor_ok = all(r["raw_ratio"] <= 1.3 for r in big)
        worst = max(r["tls_over_tcp"] for r in big)
        out.append(
            f"{rate:g} Mbit/s LAN link: target TLS <= 1.3x TCP for >= 1 MiB: "
            f"{'met' if ok else 'NOT met'} (worst {worst:.2f}x); raw blocking sockets "
            f"{'meet' if floor_ok else 'do NOT meet'} it"
        )
    return out
