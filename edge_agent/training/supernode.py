"""Start and stop a real ``flower-supernode`` for an agent that trains.

The node connects to the coordinator's SuperLink over TLS (``--root-certificates``: fedshard's CA
certificate), serves its own Runtime API on ``127.0.0.1:--port``, installs nothing at run time,
sends no telemetry and checks for no updates. Its node config tells the ClientApp where this
agent's segments, training data and feature cache are, and its training budget.
``fedshard agent --train-data DIR`` is meant to call :func:`start_supernode` and
:meth:`SuperNodeProcess.stop`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from edge_agent.training.errors import SuperNodeError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"


@dataclass(frozen=True)
class SuperNodeConfig:
    """What one agent's SuperNode needs."""

    superlink: str
    """``host:port`` of the SuperLink (its certificate must name ``host``)."""
    root_certificates: Path
    segments_dir: Path
    data_dir: Path
    work_dir: Path
    """Flower home, feature cache and log live here."""
    budget_bytes: int = 1 << 30
    port: int = 0
    """Runtime API port on 127.0.0.1 (0: pick a free one)."""
    auth_private_key: Path | None = None
    """Node-authentication key registered with the SuperLink (OpenSSH EC key), if enabled."""


@dataclass
class SuperNodeProcess:
    """A running SuperNode."""

    config: SuperNodeConfig
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def pid(self) -> int:
        """Process id (also its process group id)."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the SuperNode and every process it started; kill whatever lingers."""
        _stop_tree(self.process, grace_s, hard=False)

    def kill(self) -> None:
        """Kill the SuperNode and its children at once (simulates a device dropping out)."""
        _stop_tree(self.process, 10.0, hard=True)


def _stop_tree(proc: subprocess.Popen[bytes], grace_s: float, hard: bool) -> None:
    """Signal ``proc`` and all its descendants (Flower starts helpers in new sessions)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill() if hard else p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=grace_s)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise SuperNodeError(f"path {value!r} cannot go into a node config")
    return f'"{value}"'


def start_supernode(config: SuperNodeConfig) -> SuperNodeProcess:
    """Launch ``flower-supernode`` for this agent (offline, TLS, 127.0.0.1)."""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    port = config.port or _free_port()
    node_config = " ".join(
        [
            f"segments-dir={_quote(str(config.segments_dir))}",
            f"data-dir={_quote(str(config.data_dir))}",
            f"cache-dir={_quote(str(config.work_dir / 'cache'))}",
            f"budget-bytes={int(config.budget_bytes)}",
        ]
    )
    cmd = [
        str(Path(sys.executable).with_name("flower-supernode")),
        "--superlink", config.superlink,
        "--root-certificates", str(config.root_certificates),
        "--host", HOST,
        "--port", str(port),
        "--node-config", node_config,
    ]  # fmt: skip
    if config.auth_private_key is not None:
        cmd += ["--auth-supernode-private-key", str(config.auth_private_key)]
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(config.work_dir / "flwr-home"),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    log_path = config.work_dir / "supernode.log"
    try:
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=config.work_dir,
            )
    except OSError as exc:
        raise SuperNodeError(f"cannot start flower-supernode: {exc}") from exc
    log.info("SuperNode pid %d on %s:%d -> %s", proc.pid, HOST, port, config.superlink)
    return SuperNodeProcess(config, proc, port, log_path)
