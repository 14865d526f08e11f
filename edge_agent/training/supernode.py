"""Start and stop a real ``flower-supernode`` for an agent that trains.

The node connects to the coordinator's SuperLink over TLS (``--root-certificates``: fedshard's CA
certificate), serves its own Runtime API on ``127.0.0.1:--port``, installs nothing at run time,
sends no telemetry and checks for no updates. Its node config tells the ClientApp where this
agent's segments, training data and feature cache are, and its training budget.
``fedshard agent --train-data DIR`` runs one for the agent's whole life
(:func:`agent_supernode`), authenticated with the agent's node key (:func:`node_public_key`,
sent to the coordinator with the pairing request) and restarted whenever it exits: a SuperLink
refuses a node whose key it has not registered yet, and each training run starts a new one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edge_agent.config import AgentConfig
from edge_agent.training.errors import SuperNodeError
from edge_agent.trust.pairing import make_node_key, node_key_dir, node_public_key
from hostkit.processes import stop_tree
from protocols.ledger import LEDGER_FILE

log = logging.getLogger(__name__)

__all__ = [
    "SuperNodeConfig",
    "SuperNodeProcess",
    "SupervisedSuperNode",
    "agent_supernode",
    "make_node_key",
    "node_key_dir",
    "node_public_key",
    "start_supernode",
]

HOST = "127.0.0.1"
SUPEREXEC_POLL_S = "0.25"
"""How often Flower's SuperExec looks for work (its default, 1 s, slows every SecAgg+ stage)."""
RESTART_DELAY_S = 3.0
"""Wait before restarting a SuperNode that exited (refused, or its SuperLink went away)."""


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
    threads: int | None = None
    """CPU threads of the training processes (``OMP_NUM_THREADS``); None: all cores. Several
    SuperNodes on one machine each get a share, so that they do not oversubscribe the cores."""
    cache_dir: Path | None = None
    """What later runs reuse (the frozen prefix's activations); None: ``work_dir/cache``."""
    ledger_file: Path | None = None
    """This device's privacy ledger (:mod:`edge_agent.training.ledger`); None: no ledger is
    kept and no round is declined (labs and the coordinator's local demo agents)."""
    privacy_budget: float | None = None
    allow_non_dp: bool = False
    allow_non_secagg: bool = False


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
        stop_tree(self.process, grace_s)

    def kill(self) -> None:
        """Kill the SuperNode and its children at once (simulates a device dropping out)."""
        stop_tree(self.process, 10.0, hard=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise SuperNodeError(f"path {value!r} cannot go into a node config")
    return f'"{value}"'


def _privacy_node_config(config: SuperNodeConfig) -> list[str]:
    """The node-config entries of the privacy policy (read by the ClientApp)."""
    if config.ledger_file is None:
        return []
    entries = [
        f"ledger-file={_quote(str(config.ledger_file))}",
        f'allow-non-dp="{str(config.allow_non_dp).lower()}"',
        f'allow-non-secagg="{str(config.allow_non_secagg).lower()}"',
    ]
    if config.privacy_budget is not None:
        entries.append(f"privacy-budget={float(config.privacy_budget)!r}")
    return entries


def start_supernode(config: SuperNodeConfig) -> SuperNodeProcess:
    """Launch ``flower-supernode`` for this agent (offline, TLS, 127.0.0.1)."""
    config.work_dir.mkdir(parents=True, exist_ok=True)
    port = config.port or _free_port()
    node_config = " ".join(
        [
            f"segments-dir={_quote(str(config.segments_dir))}",
            f"data-dir={_quote(str(config.data_dir))}",
            f"cache-dir={_quote(str(config.cache_dir or config.work_dir / 'cache'))}",
            f"budget-bytes={int(config.budget_bytes)}",
            *_privacy_node_config(config),
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
    if config.threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(config.threads)
    log_path = config.work_dir / "supernode.log"
    try:
        with log_path.open("ab") as log_file:
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


class SupervisedSuperNode:
    """One SuperNode kept running: started again whenever it exits, until :meth:`stop`."""

    def __init__(self, config: SuperNodeConfig, restart_delay_s: float = RESTART_DELAY_S) -> None:
        self.config = config
        self.restart_delay_s = restart_delay_s
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._node: SuperNodeProcess | None = None
        if config.root_certificates.is_file():
            self._node = start_supernode(config)
        else:  # an unpaired agent: its SuperNode starts once pairing brought the CA
            log.info("the SuperNode waits for pairing (%s)", config.root_certificates)
        self._thread = threading.Thread(target=self._watch, name="supernode-watch", daemon=True)
        self._thread.start()

    @property
    def node(self) -> SuperNodeProcess:
        """The current SuperNode process (SuperNodeError before the first one started)."""
        with self._lock:
            if self._node is None:
                raise SuperNodeError("the SuperNode has not started: the agent is not paired")
            return self._node

    @property
    def log_path(self) -> Path:
        """The SuperNode's log (every restart appends to it)."""
        return self.config.work_dir / "supernode.log"

    def alive(self) -> bool:
        """Whether a SuperNode process is running now."""
        with self._lock:
            return self._node is not None and self._node.alive()

    def stop(self) -> None:
        """Stop watching, then stop the SuperNode and its children."""
        self._stopping.set()
        self._thread.join(timeout=30)
        with self._lock:
            if self._node is not None:
                self._node.stop()

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            with self._lock:
                node = self._node
            if node is not None and node.alive():
                continue
            if not self.config.root_certificates.is_file():
                continue
            if node is not None:
                log.warning(
                    "SuperNode exited (%s); restarting in %.0f s", node.process.returncode,
                    self.restart_delay_s,
                )  # fmt: skip
                if self._stopping.wait(self.restart_delay_s):
                    return
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self._node = start_supernode(self.config)
                except SuperNodeError as exc:
                    log.error("cannot restart the SuperNode: %s", exc)
                    continue
                self.restarts += node is not None


@contextmanager
def agent_supernode(config: AgentConfig) -> Iterator[SupervisedSuperNode]:
    """The SuperNode of an agent started with ``--train-data``, stopped when the agent stops.

    It trusts the coordinator's CA (``--ca``, or the one pairing leaves in the state dir: an
    unpaired agent's SuperNode starts once it is paired) for the SuperLink's certificate,
    authenticates with the agent's node key, and keeps its Flower home and feature cache under
    ``STATE_DIR/training``. It trains on ``--train-segments`` or else on the copy of the served
    version the coordinator sends before each run (:mod:`edge_agent.training.copies`). It is
    restarted whenever it exits, so the coordinator may start runs (and register the key) later.
    """
    from edge_agent.training.copies import CURRENT
    from edge_agent.trust.pairing import CA_FILE

    train = config.training
    if train is None:
        raise SuperNodeError("training needs --train-data")
    ca = config.tls.ca if config.tls is not None else config.state_dir / CA_FILE
    private_key, _ = make_node_key(node_key_dir(config.state_dir))
    work_dir = (config.state_dir / "training").resolve()
    segments = train.segments_dir.resolve() if train.segments_dir else work_dir / CURRENT
    node = SupervisedSuperNode(
        SuperNodeConfig(
            superlink=train.superlink,
            root_certificates=ca.resolve(),
            segments_dir=segments,
            data_dir=train.data_dir.resolve(),
            work_dir=work_dir,
            budget_bytes=train.budget_bytes,
            auth_private_key=private_key.resolve(),
            ledger_file=work_dir / LEDGER_FILE,
            privacy_budget=train.privacy_budget,
            allow_non_dp=train.allow_non_dp,
            allow_non_secagg=train.allow_non_secagg,
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
    parser.add_argument(
        "--auth-private-key", type=Path, help="node-authentication key (OpenSSH EC P-256)"
    )
    parser.add_argument("--threads", type=int, help="CPU threads of the training processes")
    parser.add_argument("--cache-dir", type=Path, help="what later runs reuse (default: work dir)")
    parser.add_argument("--ledger-file", type=Path, help="keep a privacy ledger and enforce it")
    parser.add_argument("--privacy-budget", type=float, help="largest epsilon (with a ledger)")
    parser.add_argument("--allow-non-dp", action="store_true", help="with a ledger")
    parser.add_argument("--allow-non-secagg", action="store_true", help="with a ledger")
    args = parser.parse_args(argv)
    node = start_supernode(
        SuperNodeConfig(
            superlink=args.superlink,
            root_certificates=args.root_certificates,
            segments_dir=args.segments_dir,
            data_dir=args.data_dir,
            work_dir=args.work_dir,
            budget_bytes=args.budget_bytes,
            auth_private_key=args.auth_private_key,
            threads=args.threads,
            cache_dir=args.cache_dir,
            ledger_file=args.ledger_file,
            privacy_budget=args.privacy_budget,
            allow_non_dp=args.allow_non_dp,
            allow_non_secagg=args.allow_non_secagg,
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
