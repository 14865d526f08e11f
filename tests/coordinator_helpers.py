"""Helpers for the coordinator's integration tests: real processes, the CLI, the API.

Everything binds to 127.0.0.1; every process started here is stopped by the context managers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from agent_helpers import PYTHON, REPO, AgentProc, start_agent, stop_agent

from coordinator.client import CoordinatorClient
from devtools.reference import unsharded_embeddings  # noqa: F401  (re-exported for the tests)

FEDSHARD = str(Path(PYTHON).parent / "fedshard")
CODE = re.compile(r"pairing code ([A-Z2-7]{4}-[A-Z2-7]{4})")


@dataclass
class CoordinatorProc:
    """A running ``fedshard coordinator``."""

    proc: subprocess.Popen[bytes]
    state_dir: Path
    log_path: Path
    url: str
    token: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """A raw keep-alive client with the token, for what the typed client has no verb for
        (and for hostile requests the typed client would never send)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, trust_env=False)

    def api(self, timeout: float = 120.0) -> CoordinatorClient:
        """The coordinator's typed client (:mod:`coordinator.client`), as the CLI uses it."""
        return CoordinatorClient(self.url, self.token, timeout)

    def cli(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run ``fedshard ARGS --coordinator URL --token T`` the way an operator would."""
        # ``--token=T``: a url-safe token may begin with "-", which argparse takes for an option
        command = [FEDSHARD, *args, f"--coordinator={self.url}", f"--token={self.token}"]
        env = {**os.environ, "COLUMNS": "200"}  # rich tables unwrapped, as on a wide terminal
        return subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_coordinator(
    tmp: Path, training: bool = False, extra: list[str] | None = None
) -> CoordinatorProc:
    """Start ``fedshard coordinator`` (with ``extra`` arguments) and wait until its API answers.

    With ``training``, the reference digits task is prepared as its training target first.
    """
    state = tmp / "coordinator-state"
    port = free_port()
    log_path = tmp / "coordinator.log"
    command = [FEDSHARD, "coordinator", "--state-dir", str(state)]
    command += ["--interface", "127.0.0.1", "--port", str(port)]
    if training:
        from devtools.digits import write_reference_target

        command += ["--training-target", str(write_reference_target(state))]
    command += extra or []
    env = {**os.environ, "COLUMNS": "400"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    coordinator = CoordinatorProc(proc, state, log_path, url, "")
    while True:
        match = re.search(r"console: (http://\S+)/\?token=(\S+)", coordinator.log())
        if match:
            coordinator.token = match.group(2)
            with contextlib.suppress(httpx.TransportError):
                if coordinator.api().call("GET", "/v1/devices").status == 200:
                    return coordinator
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"coordinator did not start:\n{coordinator.log()}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """SIGTERM, wait, SIGKILL if needed; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


def pairing_code(agent: AgentProc, timeout: float = 20.0) -> str:
    """The code an unpaired agent shows its operator (in its log)."""
    deadline = time.monotonic() + timeout
    while (match := CODE.search(agent.log())) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{agent.name} shows no pairing code:\n{agent.log()}")
        time.sleep(0.1)
    return match.group(1)


@contextlib.contextmanager
def unpaired_agents(
    tmp: Path, names: list[str], memory: str, extra: list[list[str]] | None = None
) -> Iterator[list[AgentProc]]:
    """Start unpaired agents (advertising over mDNS; the ``i``-th with ``extra[i]`` arguments
    when given); always stop them."""
    started: list[AgentProc] = []
    try:
        for i, name in enumerate(names):
            if started:  # reuse the first agent's measured profile
                (tmp / f"state-{name}").mkdir(parents=True, exist_ok=True)
                shutil.copy(
                    started[0].state_dir / "profile.json", tmp / f"state-{name}" / "profile.json"
                )
            args = extra[i] if extra else None
            started.append(start_agent(tmp, name, None, memory=memory, extra=args))
        yield started
    finally:
        for agent in started:
            stop_agent(agent)


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``predicate()`` until it is true or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def pair_discovered(
    coordinator: CoordinatorProc, agents: list[AgentProc], timeout: float = 15.0
) -> None:
    """Wait until the coordinator lists every one of ``agents`` (found over mDNS), then pair
    each with ``fedshard pair`` and the code it shows. :class:`RuntimeError` if one is not
    discovered within ``timeout`` seconds or its pairing fails."""
    names = {agent.name for agent in agents}
    api = coordinator.api()
    if not wait_for(lambda: names <= {d.name for d in api.devices()}, timeout):
        raise RuntimeError(f"agents not discovered in {timeout:.0f} s: {api.devices()}")
    for agent in agents:
        paired = coordinator.cli("pair", agent.name, pairing_code(agent))
        if paired.returncode != 0:
            raise RuntimeError(f"pairing {agent.name} failed: {paired.stdout}{paired.stderr}")


def paired_record(agent: AgentProc, memory_bytes: int = 256 << 20) -> Any:
    """The registry's record of a running, paired agent, as discovery would have made it."""
    from coordinator.fleet.registry import DeviceRecord
    from protocols.profile import AgentState, Announcement, DeviceProfile

    profile = DeviceProfile(
        device_id=agent.device_id,
        name=agent.name,
        memory_bytes=memory_bytes,
        gflops=10.0,
        control_port=agent.control_port,
        data_port=agent.data_port,
        cert_fingerprint="ef" * 32,
    )
    announcement = Announcement(profile=profile, state=AgentState(paired=True))
    return DeviceRecord(announcement, "127.0.0.1", agent.name, 0, 0)
