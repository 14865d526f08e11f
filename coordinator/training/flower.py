"""Real Flower processes on the coordinator: ``flower-superlink`` and ``flwr run``, all offline.

- One Flower home per run (``FLWR_HOME``), with a ``config.toml`` whose only connection points at
  our SuperLink over TLS (root certificate: fedshard's CA).
- The SuperLink gets a server certificate for ``localhost`` and its address, issued by
  :class:`coordinator.trust.ca.CertificateAuthority`, and binds one address: 127.0.0.1 unless the
  coordinator serves another interface.
- Offline: ``--disable-runtime-dependency-installation``, ``FLWR_TELEMETRY_ENABLED=0``,
  ``FLWR_DISABLE_UPDATE_CHECK=1``.
- The app that ``flwr run`` ships (a FAB) is a two-file shim generated here: its components
  import :mod:`coordinator.training.server_app` and :mod:`edge_agent.training.client_app`, which
  the SuperLink and SuperNode machines have installed, so no code is installed at run time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from coordinator.training.errors import FlowerProcessError, TrainingRunError
from coordinator.trust.ca import CertificateAuthority
from hostkit.files import write_atomic
from hostkit.processes import stop_tree
from protocols.deploy import ROLE_SUPERLINK

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SUPEREXEC_POLL_S = "0.25"
"""How often Flower's SuperExec looks for work (its default, 1 s, slows every SecAgg+ stage)."""
TLS_NAME = "localhost"
"""Certificate name of the SuperLink; the certificate also carries IP 127.0.0.1 (dialled)."""
CONNECTION = "fedshard"
APP_PACKAGE = "fedshard_flwr_app"


def offline_env(flwr_home: Path) -> dict[str, str]:
    """The environment every Flower process of a run gets."""
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PYTHONUNBUFFERED="1",
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL=SUPEREXEC_POLL_S,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def flower_bin(name: str) -> str:
    """Path of a Flower console script next to this interpreter."""
    return str(Path(sys.executable).with_name(name))


@dataclass(frozen=True)
class TlsFiles:
    """CA certificate, and the SuperLink's certificate and key, as files."""

    ca_cert: Path
    cert: Path
    key: Path


def issue_superlink_tls(ca: CertificateAuthority, out_dir: Path, host: str = HOST) -> TlsFiles:
    """A fresh P-256 key and a certificate for ``localhost`` and ``host`` from fedshard's CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    addresses = sorted({HOST, host})
    # its own role: on agents' control and data planes it is never taken for the coordinator
    issued = ca.issue_for_key(key.public_key(), TLS_NAME, ROLE_SUPERLINK, ip_addresses=addresses)
    files = TlsFiles(out_dir / "ca.pem", out_dir / "superlink.pem", out_dir / "superlink.key")
    write_atomic(files.ca_cert, ca.cert_pem)
    write_atomic(files.cert, issued.pem)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(files.key, pem, mode=0o600)
    return files


def write_app(
    app_dir: Path, secagg: bool, server_module: str = "coordinator.training.server_app"
) -> Path:
    """Write the ``flwr run`` app: pyproject plus shims importing the installed apps
    (``server_module``'s ``app`` as the ServerApp)."""
    client = "secagg_app" if secagg else "plain_app"
    pyproject = f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedshard-train"
version = "1.0.0"
description = "fedshard federated fine-tuning"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedshard"

[tool.flwr.app.components]
serverapp = "{APP_PACKAGE}.server:app"
clientapp = "{APP_PACKAGE}.client:{client}"

[tool.flwr.app.config]
run-file = ""
"""
    write_atomic(app_dir / "pyproject.toml", pyproject.encode())
    pkg = app_dir / APP_PACKAGE
    write_atomic(pkg / "__init__.py", b'"""fedshard training app shim."""\n')
    write_atomic(
        pkg / "server.py", f"from {server_module} import app\n\n__all__ = ['app']\n".encode()
    )
    write_atomic(
        pkg / "client.py",
        f"from edge_agent.training.client_app import {client}\n\n__all__ = ['{client}']\n".encode(),
    )
    return app_dir


def write_connection(flwr_home: Path, address: str, ca_cert: Path) -> None:
    """``$FLWR_HOME/config.toml`` with one default connection to our SuperLink (HOST:PORT)."""
    text = f"""[superlink]
default = "{CONNECTION}"

[superlink.{CONNECTION}]
address = "{address}"
root-certificates = "{ca_cert}"
"""
    write_atomic(flwr_home / "config.toml", text.encode())


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str, host: str = HOST
) -> None:
    """Block until ``host:port`` accepts connections; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FlowerProcessError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise FlowerProcessError(f"{what} did not listen on {host}:{port} within {timeout_s:.0f} s")


@dataclass
class SuperLink:
    """A running ``flower-superlink`` (see :func:`superlink`)."""

    port: int
    flwr_home: Path
    tls: TlsFiles
    process: subprocess.Popen[bytes]
    log_path: Path
    host: str = HOST

    @property
    def address(self) -> str:
        """What SuperNodes pass to ``--superlink``."""
        return f"{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for ``flwr`` commands against this SuperLink."""
        return offline_env(self.flwr_home)


@contextmanager
def superlink(
    work_dir: Path,
    ca: CertificateAuthority,
    start_timeout_s: float = 60.0,
    node_auth: bool = False,
    port: int = 0,
    host: str = HOST,
) -> Iterator[SuperLink]:
    """Start a SuperLink for one run under ``work_dir``; stop it (and its children) on exit.

    It listens on ``host`` only. ``port`` 0 picks a free one; a fixed port lets agents started
    with ``--train-superlink`` find it (their SuperNodes keep retrying until it is up).

    With ``node_auth`` only SuperNodes whose public key was registered with
    :func:`register_supernode` may connect.
    """
    flwr_home = work_dir / "flwr-home"
    flwr_home.mkdir(parents=True, exist_ok=True)
    tls = issue_superlink_tls(ca, work_dir / "tls", host)
    port = port or free_port(host)
    write_connection(flwr_home, f"{host}:{port}", tls.ca_cert)
    log_path = work_dir / "superlink.log"
    cmd = [
        flower_bin("flower-superlink"),
        "--host",
        host,
        "--port",
        str(port),
        "--ssl-ca-certfile",
        str(tls.ca_cert),
        "--ssl-certfile",
        str(tls.cert),
        "--ssl-keyfile",
        str(tls.key),
        "--disable-runtime-dependency-installation",
        "--database",
        str(work_dir / "superlink.db"),
    ]
    if node_auth:
        cmd.append("--enable-supernode-auth")  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd, env=offline_env(flwr_home), stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=work_dir,
        )  # fmt: skip
    try:
        wait_for_port(port, proc, start_timeout_s, "flower-superlink", host)
        tls.key.unlink(missing_ok=True)  # loaded by now: the key does not stay on disk
        log.info("SuperLink listening on %s:%d (log %s)", host, port, log_path)
        yield SuperLink(port, flwr_home, tls, proc, log_path, host)
    finally:
        stop_tree(proc)


def make_node_key(directory: Path) -> tuple[Path, Path]:
    """A fresh node-authentication key pair (EC P-256, OpenSSH format) for a local SuperNode:
    (private key path, mode 0600; public key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "node_auth_key", directory / "node_auth_key.pub"
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    write_atomic(private, pem, mode=0o600)
    text = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    write_atomic(public, text + b"\n")
    return private, public


def register_supernode(link: SuperLink, public_key: Path, timeout_s: float = 60.0) -> int:
    """``flwr supernode register KEY.pub``: allow the SuperNode holding that key to connect;
    returns its node id.

    The key is an EC (NIST P-256) public key in OpenSSH format, as the agent makes it with
    :func:`edge_agent.training.supernode.make_node_key`.
    """
    cmd = [
        flower_bin("flwr"), "supernode", "register", str(public_key), CONNECTION,
        "--format", "json",
    ]  # fmt: skip
    try:
        out = subprocess.run(
            cmd, env=link.env(), capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise FlowerProcessError("flwr supernode register did not answer") from exc
    try:
        reply = json.loads(out.stdout.decode(errors="replace"))
    except json.JSONDecodeError as exc:
        raise FlowerProcessError(f"flwr supernode register failed: {out.stdout[-1000:]!r}") from exc
    if not reply.get("success"):
        raise FlowerProcessError(f"SuperLink refused the node key: {reply}")
    node_id = reply.get("node-id")
    if not isinstance(node_id, int):
        raise FlowerProcessError(f"flwr supernode register gave no node id: {reply}")
    return node_id


def unregister_supernode(link: SuperLink, node_id: int, timeout_s: float = 60.0) -> None:
    """``flwr supernode unregister NODE_ID``: the SuperLink forgets that SuperNode (a revoked
    device's); its further messages are refused."""
    cmd = [
        flower_bin("flwr"), "supernode", "unregister", str(node_id), CONNECTION,
        "--format", "json",
    ]  # fmt: skip
    try:
        out = subprocess.run(
            cmd, env=link.env(), capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise FlowerProcessError("flwr supernode unregister did not answer") from exc
    try:
        reply = json.loads(out.stdout.decode(errors="replace"))
    except json.JSONDecodeError as exc:
        raise FlowerProcessError(
            f"flwr supernode unregister failed: {out.stdout[-1000:]!r}"
        ) from exc
    if not reply.get("success"):
        raise FlowerProcessError(f"SuperLink did not unregister node {node_id}: {reply}")


def start_run(link: SuperLink, app_dir: Path, run_file: Path, timeout_s: float = 120.0) -> int:
    """``flwr run APP fedshard --run-config run-file=...``; returns the run id."""
    cmd = [
        flower_bin("flwr"), "run", str(app_dir), CONNECTION,
        "--run-config", f'run-file="{run_file}"', "--format", "json",
    ]  # fmt: skip
    try:
        out = subprocess.run(
            cmd, env=link.env(), capture_output=True, timeout=timeout_s, check=False, cwd=app_dir
        )
    except subprocess.TimeoutExpired as exc:
        raise FlowerProcessError(f"flwr run did not return within {timeout_s:.0f} s") from exc
    text = out.stdout.decode(errors="replace")
    try:
        reply = json.loads(text)
    except json.JSONDecodeError as exc:
        err = out.stderr.decode(errors="replace")[-2000:]
        raise FlowerProcessError(
            f"flwr run failed ({out.returncode}): {text[-2000:]} {err}"
        ) from exc
    if not reply.get("success") or "run-id" not in reply:
        raise FlowerProcessError(f"flwr run refused the app: {text[-2000:]}")
    return int(reply["run-id"])


def run_status(link: SuperLink, run_id: int, timeout_s: float = 60.0) -> str:
    """The run's status string from ``flwr ls`` (e.g. ``running``, ``finished:completed``)."""
    cmd = [flower_bin("flwr"), "ls", CONNECTION, "--run-id", str(run_id), "--format", "json"]
    try:
        out = subprocess.run(
            cmd, env=link.env(), capture_output=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise FlowerProcessError("flwr ls did not answer") from exc
    try:
        reply = json.loads(out.stdout.decode(errors="replace"))
        return str(reply["runs"][0]["status"])
    except (json.JSONDecodeError, KeyError, IndexError) as exc:
        raise FlowerProcessError(f"flwr ls gave no status: {out.stdout[-500:]!r}") from exc


def tail(path: Path, limit: int = 3000) -> str:
    """The end of a log file, for error messages."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def ensure_alive(proc: subprocess.Popen[bytes], what: str, log_path: Path) -> None:
    """Raise if ``proc`` has exited."""
    if proc.poll() is not None:
        raise TrainingRunError(f"{what} exited ({proc.returncode}): {tail(log_path)}")
