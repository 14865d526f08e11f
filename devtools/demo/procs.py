"""The processes ``fedshard demo`` starts: a coordinator and agents on 127.0.0.1.

:func:`demo_processes` is a context manager that owns every child it starts and stops all of them
when it exits, whatever the reason: normal return, an exception, Ctrl-C (SIGINT), SIGTERM or
SIGHUP (all turned into :class:`KeyboardInterrupt` while it is active). Each child runs in its own
session so the terminal's Ctrl-C reaches only the demo, which then stops the children in order
(agents first, then the coordinator) with :func:`hostkit.processes.stop_tree`: SIGTERM to
the child and everything it started, SIGKILL to what does not exit in time. No threads are
started.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from hostkit.processes import stop_tree

STOP_TIMEOUT_S = 20.0
START_TIMEOUT_S = 90.0
CONSOLE_LINE = re.compile(r"console: (http://\S+)/\?token=(\S+)")
PAIRING_CODE = re.compile(r"pairing code ([A-Z2-7]{4}-[A-Z2-7]{4})")


class DemoProcessError(RuntimeError):
    """A child process did not start or died."""


@dataclass
class Child:
    """One process the demo started."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """Everything the process wrote so far (empty if its log cannot be read)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of its log."""
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None


@dataclass
class CoordinatorChild(Child):
    """The demo's coordinator: its API address, token and state dir."""

    url: str = ""
    token: str = ""
    port: int = 0
    state_dir: Path = Path()

    @property
    def console_url(self) -> str:
        """The web console's address, token included."""
        return f"{self.url}/?token={self.token}"


@dataclass
class AgentChild(Child):
    """One of the demo's agents: its state dir, memory budget and control port."""

    state_dir: Path = Path()
    memory: str = ""
    threads: int = 1
    """Its ``--threads``."""
    control_port: int = 0
    device_id: str = ""


def fedshard_command() -> list[str]:
    """The ``fedshard`` console script of this interpreter (or the same entry point via -c)."""
    script = Path(sys.executable).parent / "fedshard"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "fedshard"]


def port_is_free(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class DemoProcesses:
    """The children of one demo run; use through :func:`demo_processes`."""

    workdir: Path
    pid_file: Path | None = None
    children: list[Child] = field(default_factory=list)

    def _spawn(self, name: str, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops children in order
            )
        self._record_pid(name, proc.pid)
        return proc

    def _record_pid(self, name: str, pid: int) -> None:
        if self.pid_file is None:
            return
        with open(self.pid_file, "a", encoding="utf-8") as handle:
            handle.write(f"{pid} {name}\n")

    def start_coordinator(
        self,
        state_dir: Path,
        port: int,
        segment_cache: Path | None = None,
        training_target: Path | None = None,
        options: Sequence[str] = (),
    ) -> CoordinatorChild:
        """Start ``fedshard coordinator`` on 127.0.0.1:``port`` (with ``options``, further
        command-line options); wait until its API answers."""
        import httpx

        # heavy: httpx (coordinator extra), absent on an agent-only install whose parser imports us
        from coordinator.client import CoordinatorClient

        log_path = self.workdir / "coordinator.log"
        command = [*fedshard_command(), "coordinator", "--state-dir", str(state_dir)]
        command += ["--interface", "127.0.0.1", "--port", str(port)]
        if segment_cache is not None:
            command += ["--segment-cache", str(segment_cache)]
        if training_target is not None:
            command += ["--training-target", str(training_target)]
        command += options
        proc = self._spawn("coordinator", command, log_path)
        child = CoordinatorChild("coordinator", proc, log_path, port=port, state_dir=state_dir)
        self.children.append(child)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            match = CONSOLE_LINE.search(child.log())
            if match:
                child.url, child.token = match.group(1), match.group(2)
                api = CoordinatorClient(child.url, child.token, timeout=5)
                with contextlib.suppress(httpx.TransportError):
                    if api.call("GET", "/v1/devices").status == 200:
                        return child
            if not child.alive() or time.monotonic() > deadline:
                raise DemoProcessError(f"the coordinator did not start:\n{child.tail()}")
            time.sleep(0.1)

    def start_agent(
        self,
        name: str,
        memory: str,
        state_dir: Path,
        profile_from: Path | None = None,
        threads: int = 1,
    ) -> AgentChild:
        """Start ``python -m edge_agent agent`` with ``threads`` ONNX Runtime intra-op threads
        (1: the agents share this machine); wait for its ready file.

        ``profile_from``: a sibling's measured ``profile.json`` to reuse (saves a measurement).
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        ready = state_dir / "agent.json"
        ready.unlink(missing_ok=True)
        own_profile = state_dir / "profile.json"
        if profile_from is not None and profile_from.is_file() and not own_profile.exists():
            shutil.copy(profile_from, state_dir / "profile.json")
        command = [sys.executable, "-m", "edge_agent", "agent", "--name", name]
        command += ["--memory", memory, "--state-dir", str(state_dir), "--interface", "127.0.0.1"]
        command += ["--threads", str(threads)]
        log_path = self.workdir / f"agent-{name}.log"
        proc = self._spawn(name, command, log_path)
        child = AgentChild(
            name, proc, log_path, state_dir=state_dir, memory=memory, threads=threads
        )
        self.children.append(child)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if not child.alive() or time.monotonic() > deadline:
                raise DemoProcessError(f"agent {name} did not start:\n{child.tail()}")
            time.sleep(0.05)
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(ready.read_text())
            child.control_port, child.device_id = info["control_port"], info["device_id"]
        return child

    def restart_agent(self, child: AgentChild) -> AgentChild:
        """Start an exited agent again with its own state dir (keys, pairing, profile)."""
        if child.alive():
            raise DemoProcessError(f"agent {child.name} is still running")
        self.children.remove(child)
        return self.start_agent(child.name, child.memory, child.state_dir, threads=child.threads)

    def agent(self, name: str) -> AgentChild:
        """The running child for agent ``name``."""
        for child in self.children:
            if isinstance(child, AgentChild) and child.name == name:
                return child
        raise DemoProcessError(f"no agent named {name}")

    def check_alive(self) -> None:
        """Raise DemoProcessError if a child has exited."""
        for child in self.children:
            if not child.alive():
                raise DemoProcessError(
                    f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}"
                )

    def stop_all(self) -> list[str]:
        """Stop every child (agents first, the coordinator last); what was stopped."""
        stopped = []
        agents = [c for c in self.children if not isinstance(c, CoordinatorChild)]
        others = [c for c in self.children if isinstance(c, CoordinatorChild)]
        for child in [*reversed(agents), *others]:
            if stop_tree(child.proc, STOP_TIMEOUT_S):
                stopped.append(child.name)
        return stopped


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def demo_processes(workdir: Path, pid_file: Path | None = None) -> Iterator[DemoProcesses]:
    """Own the demo's children: every one started through the yielded object is stopped on exit.

    While active, SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread,
    so every way out passes through the ``finally`` that stops the children.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if pid_file is not None:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text("")
    procs = DemoProcesses(workdir, pid_file)
    # SIGINT too: a shell's background job inherits it ignored, and Ctrl-C must still stop us;
    # SIGHUP only when nobody (nohup) chose to ignore it
    numbers = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        numbers.append(signal.SIGHUP)
    previous = {number: signal.signal(number, _interrupt) for number in numbers}
    try:
        yield procs
    finally:
        # a second Ctrl-C (or a SIGTERM) must not cut the clean-up short
        during = {
            number: signal.signal(number, signal.SIG_IGN)
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        try:
            procs.stop_all()
        finally:
            for number, handler in {**during, **previous}.items():
                signal.signal(number, handler)
