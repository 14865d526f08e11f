"""A coordinator and paired agents in the LAN lab, for lab tests and benchmarks.

:func:`lab_cluster` builds a lab (``devtools.lab.Lab``) of a coordinator host ``h0`` and agent
hosts ``h1``..``hN`` on one bridge, each agent host with its own ``tbf`` rate (or none). It runs
``fedshard coordinator`` in ``h0`` on its lab address and an agent in every other host on that
host's address; the coordinator finds the agents by real mDNS across the bridge, and each is
paired with ``fedshard pair`` the way an operator would. The lab has no route to the machine's
own namespace, so every API call comes from a client process inside ``h0``
(``tests/lab_client.py``), reached through :class:`LabApi`: its :meth:`LabApi.client` is the
typed client of the API (:class:`~coordinator.client.CoordinatorClient`) over that process.

Used by ``tests/lab/test_lab_failover.py`` and ``bench/planner_lab.py``. Everything started here
runs inside the lab's namespaces; :func:`lab_cluster` stops it and removes the lab when it exits,
failure or not.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from agent_helpers import PYTHON, REPO, AgentProc, stop_agent
from coordinator_helpers import FEDSHARD, pairing_code, stop_process, wait_for

from coordinator.client import CoordinatorClient
from coordinator.http.device_models import DeviceView
from devtools.lab.lab import Lab
from devtools.lab.spec import LabSpec

CLIENT = Path(__file__).resolve().parent / "lab_client.py"
COORDINATOR_HOST = "h0"
API_PORT = 8470
"""The coordinator's port inside its own namespace (nothing else listens there)."""
AGENT_MEMORY = "512MiB"
START_TIMEOUT_S = 90.0
TOKEN = re.compile(r"console: http://\S+/\?token=(\S+)")


class LabClusterError(RuntimeError):
    """The lab's coordinator, agents or client did not come up or answer as expected."""


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


def client_argv(address: str, token: str, *mode: str) -> list[str]:
    """The argv of ``tests/lab_client.py`` for the coordinator at ``address`` (in ``h0``)."""
    return [PYTHON, str(CLIENT), address, str(API_PORT), token, *mode]


class _Relay(httpx.BaseTransport):
    """An httpx transport that sends each request through the client process inside ``h0``."""

    def __init__(self, ask: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._ask = ask

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Relay ``request``; httpx.ConnectError when the coordinator did not answer."""
        timeout = request.extensions.get("timeout", {}).get("read") or 60.0
        body = request.read()
        answer = self._ask(
            {
                "op": "relay",
                "method": request.method,
                "path": request.url.raw_path.decode(),
                "headers": dict(request.headers),
                "body": base64.b64encode(body).decode() if body else None,
                "timeout": timeout,
            }
        )
        if answer["status"] == 0:
            raise httpx.ConnectError(answer["error"], request=request)
        headers = [(k, v) for k, v in answer["headers"] if k.lower() not in _FRAMING]
        content = base64.b64decode(answer["body"])
        return httpx.Response(answer["status"], headers=headers, content=content, request=request)


_FRAMING = {"content-length", "transfer-encoding"}
"""Headers of the relayed wire framing (the body comes whole): httpx sets its own."""


class LabApi:
    """The coordinator's API, called through a ``lab_client.py serve`` process inside ``h0``;
    each call times out after ``timeout_s`` unless it says otherwise."""

    def __init__(self, lab: Lab, address: str, token: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._url = f"http://{address}:{API_PORT}"
        self._token = token
        self._proc = lab.popen(
            COORDINATOR_HOST,
            client_argv(address, token, "serve"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
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

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout_s if timeout is None else timeout

    def client(self, timeout: float | None = None) -> CoordinatorClient:
        """The typed client of the coordinator's API, its requests sent from inside ``h0``."""
        url, token = self._url, self._token
        return CoordinatorClient(url, token, self._timeout(timeout), transport=_Relay(self._ask))

    def call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        """One API call: its HTTP status (0: no connection), JSON body and headers (lower
        case)."""
        try:
            reply = self.client(timeout).call(method, path, body)
        except httpx.HTTPError as exc:
            return 0, repr(exc), {}
        return reply.status, reply.body, dict(reply.headers)

    def get(self, path: str) -> Any:
        """``GET path``; raises LabClusterError unless it answers 200."""
        status, body, _ = self.call("GET", path)
        if status != 200:
            raise LabClusterError(f"GET {path}: {status} {body}")
        return body

    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        """``POST path``; raises LabClusterError unless it answers 200."""
        status, reply, _ = self.call("POST", path, body, timeout)
        if status != 200:
            raise LabClusterError(f"POST {path}: {status} {reply}")
        return reply

    def load(
        self, path: str, body: Any, total: int, in_flight: int, timeout: float | None = None
    ) -> LoadRun:
        """``total`` POSTs of ``body`` with ``in_flight`` at a time, timed inside ``h0``."""
        ask = {"op": "load", "path": path, "body": body, "total": total}
        reply = self._ask({**ask, "in_flight": in_flight, "timeout": self._timeout(timeout)})
        return LoadRun(reply["latencies"], reply["errors"], float(reply["wall_s"]))

    def close(self) -> None:
        """End the client process (it exits at the end of its input)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass
class LabCluster:
    """A running lab: its coordinator (state dir, address, token, log), API client and agents."""

    lab: Lab
    work: Path
    state_dir: Path
    """The coordinator's state dir (deployed manifests are under ``deployments/``)."""
    address: str
    token: str
    coordinator_log: Path
    api: LabApi
    agents: list[AgentProc]
    """One per agent host, in host order (``h1`` first)."""

    @property
    def agent_hosts(self) -> tuple[str, ...]:
        """The agent hosts' names, which are also their devices' names."""
        return tuple(agent.name for agent in self.agents)

    def cli(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """``fedshard ARGS`` run by the operator inside ``h0``."""
        url = f"http://{self.address}:{API_PORT}"
        # ``--token=T``: a token minted before tokens avoided a leading "-" may start with one,
        # which argparse would take for an option
        command = [FEDSHARD, *args, f"--coordinator={url}", f"--token={self.token}"]
        return subprocess.run(
            self.lab.exec_argv(COORDINATOR_HOST, command),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` of the coordinator's log."""
        return "\n".join(_read(self.coordinator_log).splitlines()[-lines:])


@contextlib.contextmanager
def lab_cluster(
    work: Path,
    bandwidths_mbps: Sequence[float | None],
    on_step: Callable[[str], None] = lambda step: None,
    call_timeout_s: float = 60.0,
) -> Iterator[LabCluster]:
    """A lab with ``h0`` (coordinator, unshaped) and one agent host per entry of
    ``bandwidths_mbps`` (its tbf rate, None: unshaped), agents paired; always torn down.

    ``on_step`` hears each stage as it starts (``coordinator``, ``agents``, ``pairing``);
    ``call_timeout_s`` is the API client's default time-out per call."""
    rates = ",".join("none" if b is None else f"{b:g}" for b in [None, *bandwidths_mbps])
    spec = LabSpec.build(1 + len(bandwidths_mbps), bandwidth_mbps=rates, agents=False)
    hosts = [f"h{i}" for i in range(1, 1 + len(bandwidths_mbps))]
    with Lab(spec, work / "lab") as lab:
        coordinator: subprocess.Popen[bytes] | None = None
        api: LabApi | None = None
        agents: list[AgentProc] = []
        try:
            on_step("coordinator")
            address = lab.plan.node(COORDINATOR_HOST).address
            state_dir = work / "coordinator-state"
            coordinator, log_path, token = _start_coordinator(lab, work, state_dir, address)
            api = LabApi(lab, address, token, call_timeout_s)
            on_step("agents")
            _start_agents(lab, work, hosts, agents)
            cluster = LabCluster(lab, work, state_dir, address, token, log_path, api, agents)
            on_step("pairing")
            _pair(cluster)
            yield cluster
        finally:
            if api is not None:
                api.close()
            for agent in agents:
                stop_agent(agent)
            if coordinator is not None:
                stop_process(coordinator)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _start_coordinator(
    lab: Lab, work: Path, state_dir: Path, address: str
) -> tuple[subprocess.Popen[bytes], Path, str]:
    """``fedshard coordinator`` in ``h0`` on its lab address; the process, its log, its token."""
    log_path = work / "coordinator.log"
    command = [FEDSHARD, "coordinator", "--state-dir", str(state_dir)]
    command += ["--interface", address, "--port", str(API_PORT)]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            lab.exec_argv(COORDINATOR_HOST, command),
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "400"},
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while (match := TOKEN.search(_read(log_path))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise LabClusterError(f"coordinator did not start:\n{_read(log_path)[-3000:]}")
        time.sleep(0.1)
    return proc, log_path, match.group(1)


def _start_agents(lab: Lab, work: Path, hosts: Sequence[str], started: list[AgentProc]) -> None:
    """An unpaired agent per host, one after the other (so the coordinator sees them in host
    order), each appended to ``started`` as soon as it runs; the first one's measured profile
    is reused by the others (same CPU, same speed)."""
    for host in hosts:
        state = work / f"state-{host}"
        state.mkdir(parents=True, exist_ok=True)
        if started:
            shutil.copy(started[0].state_dir / "profile.json", state / "profile.json")
        command = [PYTHON, "-m", "edge_agent", "agent", "--name", host, "--memory", AGENT_MEMORY]
        command += ["--state-dir", str(state), "--interface", lab.plan.node(host).address]
        command += ["--threads", "1"]  # the lab's hosts share this machine's cores
        log_path = work / f"{host}.log"
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                lab.exec_argv(host, command), cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT
            )
        agent = AgentProc(name=host, state_dir=state, proc=proc, log_path=log_path)
        started.append(agent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (state / "agent.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabClusterError(f"agent {host} did not start:\n{_read(log_path)}")
            time.sleep(0.05)
        info = json.loads((state / "agent.json").read_text())
        agent.control_port, agent.data_port = info["control_port"], info["data_port"]
        agent.device_id = info["device_id"]


def _pair(cluster: LabCluster) -> None:
    """``fedshard pair NAME CODE`` for every agent, once the coordinator has found them all;
    returns when all of them are paired and online."""
    hosts = set(cluster.agent_hosts)

    def devices() -> list[DeviceView]:
        return cluster.api.client().devices()

    if not wait_for(lambda: hosts <= {d.name for d in devices()}, 60):
        raise LabClusterError(f"the agents were not discovered: {devices()}")
    for agent in cluster.agents:
        result = cluster.cli("pair", agent.name, pairing_code(agent, timeout=30.0))
        if result.returncode != 0:
            raise LabClusterError(f"pairing {agent.name} failed: {result.stdout}{result.stderr}")

    def paired() -> bool:
        return hosts <= {d.name for d in devices() if d.status == "paired" and d.online}

    if not wait_for(paired, 30):
        raise LabClusterError(f"the agents were not paired and online: {devices()}")
