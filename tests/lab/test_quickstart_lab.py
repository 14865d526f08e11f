"""The README's quick start and the first-LAN tutorial, run as written on a LAN of network
namespaces (issue 41 item 3).

The test reads the ``sh`` block under "Quick start on a real LAN" and runs its commands on a lab
of two hosts (``nas`` and ``laptop``) and the lab's control namespace as the coordinator's
machine: the coordinator's command there, the device command on each host (its name and address
put in place of the page's ``nas`` and ``192.168.1.20``), then the coordinator-side lines as one
shell script, with each device's pairing code read from its "ready" log line in place of the
page's example code. ``~`` is a fresh home per machine. It fails when the page and the product
disagree: a command or flag the CLI refuses, a pairing line that no longer shows a code, a
deploy or an embeddings answer that does not come. Needs root (network namespaces) and the
packaged MiniLM (``fedshard export minilm``).

The tutorial (``docs/tutorials/first-lan.md``) runs on the same lab, after the quick start: its
``sh`` blocks of steps 2 to 6 as the page has them: the coordinator (step 2) and an agent per host
(step 3, the page's ``nas`` name and address replaced by each host's), then steps 4 to 6 as one
shell script on the coordinator's machine (its pairing lines given each host's code, a line for a
device the lab does not have left out), and the page's OpenAI SDK snippet. The lines the page
says the coordinator and the agents print are checked against what they print. One stand-in
keeps it to about a minute: ``fedshard export gemma3-270m`` exports ``tiny-gemma3`` (the same
architecture, 15 MB of random weights) to the same place, so the deploy and the chat request run
as written; what such weights answer is not checked, only that a chat completion comes back.
Step 1 (``pip install``) is checked against the package's extras, not run (the lab has no
network); step 7 (losing a device) is what ``test_lab_failover.py`` does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.lab.executor import unavailable_reason
from devtools.lab.lab import Lab
from devtools.lab.plan import CONTROL, new_lab_id
from devtools.lab.spec import LabSpec

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorials" / "first-lan.md"
PAGE_DEVICES = {"nas": "192.168.1.20", "laptop": "192.168.1.21", "pi": "192.168.1.22"}
PAGE_MODEL_EXPORT = "fedshard export gemma3-270m "
STAND_IN_EXPORT = "fedshard export tiny-gemma3 "
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


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One lab for the quick start and the tutorial (each starts and stops its own processes)."""
    spec = LabSpec.build(len(HOSTS), names=",".join(HOSTS), agents=False)
    with Lab(spec, tmp_path_factory.mktemp("lab"), lab_id=new_lab_id()) as running:
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


def _run_client(lab: Lab, script: str, home: Path, started: Started) -> dict[str, Any]:
    """Run the page's client lines as one script on the coordinator's machine; it must pair
    every host, and its last line is the JSON answer it ends with."""
    done = subprocess.run(
        lab.exec_argv(CONTROL, ["bash", "-ec", script]),
        env=_environment(home),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{started.tails()}"
    for host in HOSTS:
        assert f"paired {host}" in done.stdout, done.stdout
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


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
        answer = _run_client(lab, "\n".join(script), tmp_path, started)
        vectors = [item["embedding"] for item in answer["data"]]
        assert len(vectors) == 2 and all(len(v) == 384 for v in vectors), answer
    finally:
        started.stop()


# ------------------------------------------------------------------------- the first-LAN tutorial


def tutorial_blocks() -> dict[int, list[str]]:
    """The tutorial's fenced blocks by step number (``## N. ...``), each its language on the
    first line and its text after."""
    steps: dict[int, list[str]] = {}
    step = 0
    lines = TUTORIAL.read_text(encoding="utf-8").splitlines()
    k = 0
    while k < len(lines):
        found = re.match(r"^## (\d+)\. ", lines[k])
        if found:
            step = int(found.group(1))
        elif lines[k].startswith("```") and len(lines[k]) > 3:
            end = lines.index("```", k + 1)
            steps.setdefault(step, []).append(lines[k][3:] + "\n" + "\n".join(lines[k + 1 : end]))
            k = end
        k += 1
    return steps


def _blocks(step: int, lang: str) -> list[str]:
    return [
        b.split("\n", 1)[1] for b in tutorial_blocks().get(step, []) if b.startswith(lang + "\n")
    ]


def _one_command(block: str) -> str:
    """A block of one command, its continuation lines joined."""
    return re.sub(r"\\\n\s*", "", block).strip()


def test_the_tutorial_installs_extras_the_package_has() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = re.findall(r"fedshard\[([a-z,]+)\]", "\n".join(_blocks(1, "sh")))
    assert named, "step 1 installs nothing"
    for group in named:
        assert set(group.split(",")) <= set(extras), group


def test_the_tutorial_has_its_steps() -> None:
    (server,) = _blocks(2, "sh")
    (device,) = _blocks(3, "sh")
    assert _one_command(server).startswith("fedshard coordinator ") and PAGE_COORDINATOR in server
    assert _one_command(device).startswith("fedshard agent --name nas ")
    assert any(line.startswith("fedshard pair nas ") for line in _blocks(4, "sh")[0].splitlines())
    assert PAGE_MODEL_EXPORT in _blocks(5, "sh")[0]
    assert "/v1/chat/completions" in _blocks(6, "sh")[0] and _blocks(6, "python")


def _client_script(codes: dict[str, str], coordinator: str) -> str:
    """Steps 4 to 6 as one script: each pairing line given its host's code (a device the lab
    does not have is left out), the model export's stand-in, the page's addresses the lab's."""
    lines = []
    for line in "\n".join(b for step in (4, 5, 6) for b in _blocks(step, "sh")).splitlines():
        paired = re.match(r"^fedshard pair (\S+) (\S+) ", line)
        if paired:
            if paired.group(1) not in codes:
                continue
            line = line.replace(f" {paired.group(2)} ", f" {codes[paired.group(1)]} ", 1)
        lines.append(line.replace(PAGE_MODEL_EXPORT, STAND_IN_EXPORT))
    return "\n".join(lines).replace(PAGE_COORDINATOR, coordinator)


def _said(page_lines: str, log: str, addresses: dict[str, str]) -> None:
    """Each line of a ``text`` block the page says is printed (its example addresses made the
    lab's; ``...`` and a device's measured GFLOP/s and GB/s stand for anything) is in ``log``."""
    for line in page_lines.splitlines():
        for page, real in addresses.items():
            line = line.replace(page, real)
        line = re.sub(r"[\d.]+ (GFLOP/s|GB/s)", r"... \1", line)
        parts = [re.escape(p.strip()) for p in line.split("...")]
        pattern = r".*?".join(p for p in parts if p)
        assert re.search(pattern, log), f"the page says {line!r}; printed:\n{log[-3000:]}"


def test_the_first_lan_tutorial_runs_as_written(lab: Lab, tmp_path: Path) -> None:
    coordinator = lab.plan.control.address
    home = tmp_path / "coordinator-home"
    started = Started(tmp_path)
    began = time.monotonic()
    try:
        (server,) = _blocks(2, "sh")
        line = _one_command(server).replace(PAGE_COORDINATOR, coordinator)
        log = started.start(lab, CONTROL, line, home)
        _wait_for(log, re.compile(r"console: http://"), started)
        (printed,) = _blocks(2, "text")
        _said(printed, log.read_text(), {PAGE_COORDINATOR: coordinator})
        (device,) = _blocks(3, "sh")
        (ready,) = _blocks(3, "text")
        logs, codes = {}, {}
        for host in HOSTS:  # started together: each measures its device first
            address = lab.plan.node(host).address
            line = _one_command(device).replace("--name nas ", f"--name {host} ")
            line = line.replace(PAGE_DEVICES["nas"], address)
            logs[host] = started.start(lab, host, line, tmp_path / host)
        for host, agent_log in logs.items():
            codes[host] = _wait_for(agent_log, CODE, started).group(1)
            page = ready.replace(" nas ", f" {host} ").replace(PAGE_CODE, codes[host])
            _said(page, agent_log.read_text(), {PAGE_DEVICES["nas"]: lab.plan.node(host).address})
            code_file = tmp_path / host / ".fedshard" / "agent" / "pairing-code"
            assert code_file.read_text().strip() == codes[host]  # where the page says it is
        print(f"tutorial: coordinator and agents ready after {time.monotonic() - began:.0f} s")
        answer = _run_client(lab, _client_script(codes, coordinator), home, started)
        print(f"tutorial: steps 4 to 6 done after {time.monotonic() - began:.0f} s")
        assert answer["object"] == "chat.completion" and answer["model"] == "gemma3-270m"
        assert answer["choices"][0]["message"]["role"] == "assistant", answer
        assert answer["usage"]["completion_tokens"] > 0, answer
        token = (home / ".fedshard" / "coordinator" / "api_token").read_text().strip()
        (snippet,) = _blocks(6, "python")
        sdk = subprocess.run(
            lab.exec_argv(CONTROL, [sys.executable, "-c", snippet.replace("THE TOKEN", token)
                                    .replace(PAGE_COORDINATOR, coordinator)]),
            env=_environment(home),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip
        assert sdk.returncode == 0, f"{sdk.stdout}\n{sdk.stderr}"
    finally:
        started.stop()
