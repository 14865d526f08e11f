"""A coordinator and paired agents in the LAN lab, driven from inside the coordinator's host.

The approach of ``tests/test_lab_failover.py``, cut to what a benchmark needs. A lab of one
coordinator host ``h0`` and agent hosts ``h1``..``hN`` on one bridge, each agent host with its
own ``tbf`` rate (or none): ``fedshard coordinator`` in ``h0`` on its lab address, an agent in
every other host on that host's address, found by real mDNS across the bridge and paired with
``fedshard pair`` the way an operator would. The lab has no route to the machine's own
namespace, so every API call and every timed request comes from a client process inside ``h0``
(this file run as ``python bench/_lab_cluster.py client ADDRESS PORT TOKEN``): it answers one
JSON command per stdin line, either one API call or a timed load run with requests in flight.

Everything started here runs inside the lab's namespaces, and the lab stops whatever is left in
them and removes them when :func:`lab_cluster` exits, failure or not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
FEDSHARD = str(Path(PYTHON).parent / "fedshard")
COORDINATOR_HOST = "h0"
API_PORT = 8470
"""The coordinator's port inside its own namespace (nothing else listens there)."""
AGENT_MEMORY = "512MiB"
START_TIMEOUT_S = 90.0
CODE = re.compile(r"pairing code ([A-Z2-7]{4}-[A-Z2-7]{4})")
TOKEN = re.compile(r"console: http://\S+/\?token=(\S+)")


class LabClusterError(RuntimeError):
    """The lab's coordinator, agents or client did not come up or answer as expected."""


# --------------------------------------------------------------------------- client in h0


def _call(conn: http.client.HTTPConnection, method: str, path: str, body: Any, token: str) -> Any:
    headers = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    reply = conn.getresponse()
    raw = reply.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, parsed


def _one_call(host: str, port: int, token: str, ask: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=float(ask.get("timeout", 60.0)))
    try:
        status, headers, body = _call(conn, ask["method"], ask["path"], ask.get("body"), token)
    except (OSError, http.client.HTTPException) as exc:
        return {"status": 0, "headers": {}, "body": repr(exc)}
    finally:
        conn.close()
    return {"status": status, "headers": headers, "body": body}


def _load(host: str, port: int, token: str, ask: dict[str, Any]) -> dict[str, Any]:
    """``total`` POSTs of one body, ``in_flight`` threads each with its own keep-alive
    connection; per-request latency from send to answer, and the wall time of the whole run."""
    total, in_flight = int(ask["total"]), int(ask["in_flight"])
    timeout = float(ask.get("timeout", 60.0))
    lock = threading.Lock()
    issued = [0]
    latencies: list[float] = []
    errors: list[str] = []

    def worker() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        while True:
            with lock:
                if issued[0] >= total:
                    break
                issued[0] += 1
            start = time.perf_counter()
            try:
                status, _, body = _call(conn, "POST", ask["path"], ask["body"], token)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
                status, body = 0, repr(exc)
            took = time.perf_counter() - start
            with lock:
                if status == 200:
                    latencies.append(took)
                else:
                    errors.append(f"{status}: {str(body)[:300]}")
        conn.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"latencies": latencies, "errors": errors, "wall_s": time.perf_counter() - started}


def client_main(argv: Sequence[str]) -> int:
    """The client inside ``h0``: one JSON command per stdin line, one JSON answer per line."""
    host, port, token = argv[0], int(argv[1]), argv[2]
    for line in sys.stdin:
        ask = json.loads(line)
        if ask["op"] == "load":
            answer = _load(host, port, token, ask)
        else:
            answer = _one_call(host, port, token, ask)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------- driver side


@dataclass(frozen=True)
class LoadRun:
    """A timed run of requests through the coordinator, as the client in ``h0`` saw it."""

    latencies_s: list[float]
    errors: list[str]
    wall_s: float

    @property
    def throughput(self) -> float:
        """Answered requests per second of wall time."""
        return len(self.latencies_s) / self.wall_s if self.wall_s > 0 else 0.0


class LabApi:
    """The coordinator's API, called through the client process inside ``h0``."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._proc = proc
        self._lock = threading.Lock()

    def _ask(self, ask: dict[str, Any]) -> dict[str, Any]:
        if self._proc.stdin is None or self._proc.stdout is None:
            raise LabClusterError("the client in the lab has no pipes")
        with self._lock:
            self._proc.stdin.write(json.dumps(ask) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise LabClusterError("the client in the lab exited")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(
        self, method: str, path: str, body: Any = None, timeout: float = 60.0
    ) -> tuple[int, Any]:
        """One API call: its HTTP status (0: no connection) and JSON body."""
        reply = self._ask(
            {"op": "call", "method": method, "path": path, "body": body, "timeout": timeout}
        )
        return int(reply["status"]), reply["body"]

    def get(self, path: str) -> Any:
        """``GET path``; raises LabClusterError unless it answers 200."""
        status, body = self.call("GET", path)
        if status != 200:
            raise LabClusterError(f"GET {path}: {status} {body}")
        return body

    def post(self, path: str, body: Any, timeout: float = 60.0) -> Any:
        """``POST path``; raises LabClusterError unless it answers 200."""
        status, reply = self.call("POST", path, body, timeout)
        if status != 200:
            raise LabClusterError(f"POST {path}: {status} {reply}")
        return reply

    def load(
        self, path: str, body: Any, total: int, in_flight: int, timeout: float = 60.0
    ) -> LoadRun:
        """``total`` POSTs of ``body`` with ``in_flight`` at a time, timed inside ``h0``."""
        ask = {"op": "load", "path": path, "body": body, "total": total}
        reply = self._ask({**ask, "in_flight": in_flight, "timeout": timeout})
        return LoadRun(reply["latencies"], reply["errors"], float(reply["wall_s"]))

    def close(self) -> None:
        """End the client process."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        _stop(self._proc)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass
class LabCluster:
    """A running lab: its coordinator (state dir, address, token), API client and agents."""

    lab: Any
    """The :class:`coordinator.lab.lab.Lab`."""
    work: Path
    state_dir: Path
    """The coordinator's state dir (deployed manifests are under ``deployments/``)."""
    address: str
    token: str
    api: LabApi
    agent_hosts: tuple[str, ...]

    def cli(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """``fedshard ARGS`` run by the operator inside ``h0``."""
        url = f"http://{self.address}:{API_PORT}"
        command = [FEDSHARD, *args, "--coordinator", url, "--token", self.token]
        return subprocess.run(
            self.lab.exec_argv(COORDINATOR_HOST, command),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def lab_unavailable() -> str:
    """Why the lab cannot run here ('' when it can)."""
    from coordinator.lab.executor import unavailable_reason

    return unavailable_reason()


@contextlib.contextmanager
def lab_cluster(
    work: Path, bandwidths_mbps: Sequence[float | None], on_step: Callable[[str], None]
) -> Iterator[LabCluster]:
    """A lab with ``h0`` (coordinator, unshaped) and one agent host per entry of
    ``bandwidths_mbps`` (its tbf rate, None: unshaped), agents paired; always torn down."""
    from coordinator.lab.lab import Lab
    from coordinator.lab.spec import LabSpec

    rates = ",".join("none" if b is None else f"{b:g}" for b in [None, *bandwidths_mbps])
    spec = LabSpec.build(1 + len(bandwidths_mbps), bandwidth_mbps=rates, agents=False)
    hosts = tuple(f"h{i}" for i in range(1, 1 + len(bandwidths_mbps)))
    procs: list[subprocess.Popen[Any]] = []
    logs: list[IO[bytes]] = []
    with Lab(spec, work / "lab") as lab:
        api: LabApi | None = None
        try:
            on_step("coordinator")
            address = lab.plan.node(COORDINATOR_HOST).address
            state_dir = work / "coordinator-state"
            token = _start_coordinator(lab, work, state_dir, address, procs, logs)
            client = [PYTHON, str(Path(__file__).resolve()), "client", address, str(API_PORT)]
            api = LabApi(
                lab.popen(
                    COORDINATOR_HOST,
                    [*client, token],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    cwd=REPO,
                )
            )
            on_step("agents")
            agent_logs = _start_agents(lab, work, hosts, procs, logs)
            cluster = LabCluster(lab, work, state_dir, address, token, api, hosts)
            on_step("pairing")
            _pair(cluster, agent_logs)
            yield cluster
        finally:
            if api is not None:
                api.close()
            for proc in reversed(procs):
                _stop(proc)
            for log in logs:
                log.close()


def _stop(proc: subprocess.Popen[Any], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _start_coordinator(
    lab: Any,
    work: Path,
    state_dir: Path,
    address: str,
    procs: list[subprocess.Popen[Any]],
    logs: list[IO[bytes]],
) -> str:
    """``fedshard coordinator`` in ``h0`` on its lab address; its API token."""
    log_path = work / "coordinator.log"
    command = [FEDSHARD, "coordinator", "--state-dir", str(state_dir)]
    command += ["--interface", address, "--port", str(API_PORT)]
    log_file = log_path.open("wb")
    logs.append(log_file)
    proc = subprocess.Popen(
        lab.exec_argv(COORDINATOR_HOST, command),
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "COLUMNS": "400"},
    )
    procs.append(proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (match := TOKEN.search(_read(log_path))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise LabClusterError(f"coordinator did not start:\n{_read(log_path)[-3000:]}")
        time.sleep(0.1)
    return match.group(1)


def _start_agents(
    lab: Any,
    work: Path,
    hosts: Sequence[str],
    procs: list[subprocess.Popen[Any]],
    logs: list[IO[bytes]],
) -> dict[str, Path]:
    """An unpaired agent per host, one after the other (so the coordinator sees them in host
    order); the first one's measured profile is reused by the others (same CPU, same speed)."""
    log_paths: dict[str, Path] = {}
    first: Path | None = None
    for host in hosts:
        state = work / f"state-{host}"
        state.mkdir(parents=True, exist_ok=True)
        if first is not None:
            shutil.copy(first / "profile.json", state / "profile.json")
        command = [PYTHON, "-m", "edge_agent", "agent", "--name", host, "--memory", AGENT_MEMORY]
        command += ["--state-dir", str(state), "--interface", lab.plan.node(host).address]
        log_paths[host] = work / f"{host}.log"
        log_file = log_paths[host].open("wb")
        logs.append(log_file)
        proc = subprocess.Popen(
            lab.exec_argv(host, command), cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT
        )
        procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (state / "agent.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabClusterError(f"agent {host} did not start:\n{_read(log_paths[host])}")
            time.sleep(0.05)
        first = first or state
    return log_paths


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise LabClusterError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _pairing_code(log_path: Path, timeout_s: float = 30.0) -> str:
    """The code an unpaired agent shows its operator (in its log)."""
    deadline = time.monotonic() + timeout_s
    while (match := CODE.search(_read(log_path))) is None:
        if time.monotonic() > deadline:
            raise LabClusterError(f"no pairing code in {log_path.name}:\n{_read(log_path)}")
        time.sleep(0.1)
    return match.group(1)


def _pair(cluster: LabCluster, agent_logs: dict[str, Path]) -> None:
    """``fedshard pair NAME CODE`` for every agent, once the coordinator has found them all."""
    hosts = set(cluster.agent_hosts)

    def devices() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = cluster.api.get("/v1/devices")
        return found

    _wait(lambda: hosts <= {d["name"] for d in devices()}, 60, "the agents to be discovered")
    for host in cluster.agent_hosts:
        result = cluster.cli("pair", host, _pairing_code(agent_logs[host]))
        if result.returncode != 0:
            raise LabClusterError(f"pairing {host} failed: {result.stdout}{result.stderr}")

    def paired() -> bool:
        ready = {d["name"] for d in devices() if d["status"] == "paired" and d["online"]}
        return hosts <= ready

    _wait(paired, 30, "the agents to be paired and online")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "client":
        sys.exit(client_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} client ADDRESS PORT TOKEN")
