"""The README's quick start, run as written on a LAN of network namespaces (issue 41 item 3).

The test reads the ``sh`` block under "Quick start on a real LAN" and runs its commands on a lab
of two hosts (``nas`` and ``laptop``) and the lab's control namespace as the coordinator's
machine: the coordinator's command there, the device command on each host (its name and address
put in place of the page's ``nas`` and ``192.168.1.20``), then the coordinator-side lines as one
shell script, with each device's pairing code read from its "ready" log line in place of the
page's example code. ``~`` is a fresh home per machine. It fails when the page and the product
disagree: a command or flag the CLI refuses, a pairing line that no longer shows a code, a
deploy or an embeddings answer that does not come. Needs root (network namespaces) and the
packaged MiniLM (``fedshard export minilm``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.lab.executor import unavailable_reason
from devtools.lab.lab import Lab
from devtools.lab.plan import CONTROL, new_lab_id
from devtools.lab.spec import LabSpec

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HEADING = "## Quick start on a real LAN"
PAGE_COORDINATOR = "192.168.1.10"
PAGE_DEVICE = ("nas", "192.168.1.20")
PAGE_CODE = "7K3Q-XW9P"
HOSTS = ("nas", "laptop")
CODE = re.compile(r"pairing code ([A-Z0-9]{4}-[A-Z0-9]{4})")
READY_S = 120.0

pytestmark = [
    pytest.mark.skipif(bool(unavailable_reason()), reason=unavailable_reason() or "n/a"),
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


def quick_start() -> tuple[str, str, list[str]]:
    """The page's block: the coordinator's command, the device command, the client lines."""
    text = README.read_text(encoding="utf-8").split(HEADING, 1)[1]
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    roles: dict[str, list[str]] = {"coordinator": [], "device": [], "client": []}
    role = "coordinator"
    for line in block.splitlines():
        if line.startswith("#"):
            role = "device" if "on each device" in line else "client" if roles["device"] else role
            continue
        if line.strip():
            roles[role].append(line)
    (server,), (device,) = roles["coordinator"], roles["device"]
    return server, device, roles["client"]


def test_the_page_has_the_three_roles() -> None:
    server, device, client = quick_start()
    assert server.startswith("fedshard coordinator ") and PAGE_COORDINATOR in server
    assert device.startswith("fedshard agent ") and PAGE_DEVICE[1] in device
    assert any(line.startswith("fedshard pair ") and PAGE_CODE in line for line in client)
    assert any("/v1/" in line for line in client)


def _environment(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("FEDSHARD_TOKEN", None)
    return env


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    spec = LabSpec.build(len(HOSTS), names=",".join(HOSTS), agents=False)
    with Lab(spec, tmp_path / "lab", lab_id=new_lab_id()) as running:
        yield running


class Started:
    """Processes started in the lab, each with its log file; stopped with SIGTERM at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[tuple[subprocess.Popen[str], Path]] = []

    def start(self, lab: Lab, host: str, line: str, home: Path) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{host}.log"
        with log.open("w") as out:
            proc = lab.popen(
                host,
                ["bash", "-c", f"exec {line}"],
                env=_environment(home),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append((proc, log))
        return log

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for _, log in self.procs)


def _wait_for(log: Path, pattern: re.Pattern[str], started: Started) -> re.Match[str]:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        found = pattern.search(log.read_text(errors="replace"))
        if found is not None:
            return found
        for proc, _ in started.procs:
            assert proc.poll() is None, f"a process exited early:\n{started.tails()}"
        time.sleep(0.5)
    raise AssertionError(f"{pattern.pattern!r} not seen in {log.name}:\n{started.tails()}")


def test_the_quick_start_runs_as_written(lab: Lab, tmp_path: Path) -> None:
    server, device, client = quick_start()
    coordinator = lab.plan.control.address
    started = Started(tmp_path)
    try:
        log = started.start(lab, CONTROL, server.replace(PAGE_COORDINATOR, coordinator), tmp_path)
        _wait_for(log, re.compile(r"console: http://"), started)
        codes = {}
        for host in HOSTS:
            line = device.replace(f"--name {PAGE_DEVICE[0]} ", f"--name {host} ")
            line = line.replace(PAGE_DEVICE[1], lab.plan.node(host).address)
            agent_log = started.start(lab, host, line, tmp_path / host)
            codes[host] = _wait_for(agent_log, CODE, started).group(1)
        script = []
        for line in client:
            line = line.replace(PAGE_COORDINATOR, coordinator)
            if line.startswith("fedshard pair "):
                script += [
                    line.replace(f" {PAGE_DEVICE[0]} {PAGE_CODE} ", f" {host} {code} ")
                    for host, code in codes.items()
                ]
            else:
                script.append(line)
        done = subprocess.run(
            lab.exec_argv(CONTROL, ["bash", "-ec", "\n".join(script)]),
            env=_environment(tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{started.tails()}"
        for host in HOSTS:
            assert f"paired {host}" in done.stdout, done.stdout
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        vectors = [item["embedding"] for item in answer["data"]]
        assert len(vectors) == 2 and all(len(v) == 384 for v in vectors), answer
    finally:
        started.stop()
