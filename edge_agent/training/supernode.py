"""Start and stop a real ``flower-supernode`` for an agent that trains.

The node connects to the coordinator's SuperLink over TLS (``--root-certificates``: fedshard's CA
certificate), serves its own Runtime API on ``127.0.0.1:--port``, installs nothing at run time,
sends no telemetry and checks for no updates. Its node config tells the ClientApp where this
agent's segments, training data and feature cache are, and its training budget.
``fedshard agent --train-data DIR`` runs one for the agent's whole life
(:func:`agent_supernode`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edge_agent.config import AgentConfig
from edge_agent.training.errors import SuperNodeError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SUPEREXEC_POLL_S = "0.25"
"""How often Flower's SuperExec looks for work (its default, 1 s, slows every SecAgg+ stage)."""


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


def make_node_key(directory: Path) -> tuple[Path, Path]:
    """Create this agent's node-authentication key pair (EC P-256, OpenSSH format).

    Returns (private key path, public key path); the public key is what the coordinator
    registers with its SuperLink. An existing pair is reused.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private, public = directory / "node_auth_key", directory / "node_auth_key.pub"
    if private.is_file() and public.is_file():
        return private, public
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return private, public


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
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL=SUPEREXEC_POLL_S,
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


@contextmanager
def agent_supernode(config: AgentConfig) -> Iterator[SuperNodeProcess]:
    """The SuperNode of an agent started with ``--train-data``, stopped when the agent stops.

    It trusts the coordinator's CA (``--ca``) for the SuperLink's certificate and keeps its
    Flower home and feature cache under ``STATE_DIR/training``. It keeps retrying until the
    SuperLink is up, so the coordinator may start runs later.
    """
    train, tls = config.training, config.tls
    if train is None or tls is None:
        raise SuperNodeError("training needs --train-data and the coordinator's CA (--ca)")
    node = start_supernode(
        SuperNodeConfig(
            superlink=train.superlink,
            root_certificates=tls.ca,
            segments_dir=train.segments_dir.resolve(),
            data_dir=train.data_dir.resolve(),
            work_dir=(config.state_dir / "training").resolve(),
            budget_bytes=train.budget_bytes,
        )
    )
    try:
        yield node
    finally:
        node.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m edge_agent.training.supernode``: run one SuperNode until terminated.

    Lets the coordinator's demo mode start local agents as separate processes without
    importing :mod:`edge_agent`.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m edge_agent.training.supernode")
    parser.add_argument("--superlink", required=True)
    parser.add_argument("--root-certificates", type=Path, required=True)
    parser.add_argument("--segments-dir", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--budget-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)
    node = start_supernode(
        SuperNodeConfig(
            superlink=args.superlink,
            root_certificates=args.root_certificates,
            segments_dir=args.segments_dir,
            data_dir=args.data_dir,
            work_dir=args.work_dir,
            budget_bytes=args.budget_bytes,
        )
    )

    def _terminate(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return node.process.wait()
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
