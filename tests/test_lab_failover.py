"""Integration (slow, root): a link cut in the LAN lab is handled like a killed agent.

A lab of four hosts on one bridge: the coordinator in ``h0`` (API and mDNS on its lab address),
an agent in each of ``h1``-``h3`` (each on its own lab address), paired with ``fedshard pair``
and serving MiniLM in three segments. A client inside ``h0`` (the lab has no route to the
machine's own namespace) streams embedding requests with several in flight; then the bridge
port of the agent holding the middle segment goes down, the way a cable is pulled. A cut link
sends no RST and no FIN: the agent is not dead, it simply stops answering.

- every request gets exactly one answer, equal to the unsharded model's;
- the coordinator notices the loss within 3 s, re-plans on the two devices left and says so in
  ``GET /v1/failover``;
- when the port comes back up the device rejoins and the plan expands to three devices again;
- under caps where the two devices left cannot hold the model, cutting the big one's link gets
  requests a 503 with the reason, nothing hangs, and the model is served again once it returns.

The lab (namespaces, veths, bridge) and every process in it are removed even when a test fails.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from agent_helpers import PYTHON, REPO, AgentProc, minilm_model, stop_agent
from coordinator_helpers import (
    FEDSHARD,
    pairing_code,
    stop_process,
    unsharded_embeddings,
    wait_for,
)

from coordinator.lab.executor import lab_netns, run_command, unavailable_reason
from coordinator.lab.lab import Lab
from coordinator.lab.plan import HostPlan
from coordinator.lab.spec import LabSpec
from edge_agent.links import UNACKED_TIMEOUT_S

log = logging.getLogger(__name__)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(unavailable_reason()), reason=unavailable_reason() or "n/a"),
]

MODEL_ID = "all-minilm-l6-v2"
COORDINATOR_HOST = "h0"
AGENT_HOSTS = ("h1", "h2", "h3")
API_PORT = 8470
"""The coordinator's port inside its own namespace (nothing else listens there)."""
AGENT_MEMORY = "512MiB"
MB = 1000**2
SPARE_CAPS = (60, 60, 60)
"""Planning caps (MB) that force three segments, and any two devices can hold the model."""
TIGHT_CAPS = (70, 30, 30)
"""Planning caps (MB) that force three segments, and no two without the first can hold it."""
CLIENT_TIMEOUT_S = 150.0
"""Longer than a request may wait for a re-plan: a request that hangs fails the test."""
TOTAL, IN_FLIGHT, CUT_AFTER = 300, 8, 100
SENTENCES = [
    "A quick brown fox jumps over the lazy dog.",
    "The coordinator splits one network across the devices of a local network.",
    "Sharding here means runtime placement of tensors.",
    "Paris is the capital of France.",
    "How do I bake bread at home?",
    "Every accepted request gets exactly one answer.",
    "a pulled cable sends no goodbye",
    "short",
    " ".join(["A long request fills the data-plane links with bigger activations."] * 12),
]
"""Short and long inputs: the long one makes frames of a few hundred kB, so the frames stranded
on a cut link can fill its socket buffers."""

CLIENT = r"""
import http.client, json, sys, threading

host, port, token, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5]
timeout = float(sys.argv[4])
HEADERS = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}


def call(method, path, body):
    # one call on a fresh connection: no keep-alive that the server may close under us
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=HEADERS)
        reply = conn.getresponse()
        raw = reply.read()
    except (OSError, http.client.HTTPException) as exc:
        return 0, {}, repr(exc)
    finally:
        conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, parsed


def serve():
    for line in sys.stdin:
        ask = json.loads(line)
        status, headers, body = call(ask["method"], ask["path"], ask.get("body"))
        print(json.dumps({"status": status, "headers": headers, "body": body}), flush=True)


def stream(total, in_flight, model, texts):
    lock = threading.Lock()
    todo = iter(range(total))

    def worker():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            ask = {"model": model, "input": texts[i % len(texts)]}
            status, headers, body = call("POST", "/v1/embeddings", ask)
            out = {"i": i, "status": status}
            out["version"] = headers.get("x-fedshard-plan-version")
            if status == 200:
                out["embedding"] = body["data"][0]["embedding"]
            else:
                out["detail"] = body
            with lock:
                print(json.dumps(out), flush=True)

    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if mode == "api":
    serve()
else:
    stream(int(sys.argv[6]), int(sys.argv[7]), sys.argv[8], json.loads(sys.argv[9]))
"""
"""The client that runs inside the coordinator's namespace: ``api`` answers one API call per
line of stdin; ``stream`` sends embedding requests and prints one line per answer."""


def _client_argv(address: str, token: str, mode: str, *extra: str) -> list[str]:
    return [
        PYTHON,
        "-c",
        CLIENT,
        address,
        str(API_PORT),
        token,
        str(CLIENT_TIMEOUT_S),
        mode,
        *extra,
    ]


class NsApi:
    """The coordinator's API, called through a client process inside its namespace."""

    def __init__(self, lab: Lab, address: str, token: str) -> None:
        self._proc = lab.popen(
            COORDINATOR_HOST,
            _client_argv(address, token, "api"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._lock = threading.Lock()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any, dict[str, str]]:
        """One API call: its HTTP status (0: no connection), JSON body and headers."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps({"method": method, "path": path, "body": body}))
            self._proc.stdin.write("\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        assert line, "the API client in the lab exited"
        reply = json.loads(line)
        return int(reply["status"]), reply["body"], reply["headers"]

    def get(self, path: str) -> Any:
        """``GET path``; fails the test unless it answers 200."""
        status, body, _ = self.call("GET", path)
        assert status == 200, f"GET {path}: {status} {body}"
        return body

    def close(self) -> None:
        """End the client process."""
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
class Answer:
    """One request's outcome as the client inside the lab saw it."""

    status: int
    version: int | None
    embedding: np.ndarray | None
    detail: Any


class Stream:
    """``total`` embedding requests, ``in_flight`` at a time, from inside the coordinator's
    namespace; answers fill in by request index as they arrive."""

    def __init__(self, lab: Lab, address: str, token: str, total: int, in_flight: int) -> None:
        extra = [str(total), str(in_flight), MODEL_ID, json.dumps(SENTENCES)]
        self.answers: dict[int, Answer] = {}
        self._proc = lab.popen(
            COORDINATOR_HOST,
            _client_argv(address, token, "stream", *extra),
            stdout=subprocess.PIPE,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            item = json.loads(line)
            ok = item["status"] == 200
            answer = Answer(
                status=item["status"],
                version=int(item["version"]) if item["version"] else None,
                embedding=np.array(item["embedding"], dtype=np.float32) if ok else None,
                detail=item.get("detail"),
            )
            self.answers[item["i"]] = answer

    def answered(self) -> int:
        """How many requests have been answered so far."""
        return len(self.answers)

    def join(self, timeout: float) -> bool:
        """Wait for the client to finish; False if it is still running after ``timeout``."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self._reader.join(10)
        return True

    def stop(self) -> None:
        """Kill the client if it still runs."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(10)
        self._reader.join(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass
class CutLab:
    """The lab, its coordinator and agents, and what the answers must be."""

    lab: Lab
    tmp: Path
    coordinator: subprocess.Popen[bytes]
    coordinator_log: Path
    address: str
    token: str
    api: NsApi
    agents: list[AgentProc]
    model: Path
    expected: dict[str, np.ndarray]
    cut: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Scenario -> the device whose link was cut, and the wall-clock time it was cut."""

    def cli(self, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        """``fedshard ARGS`` run by the operator inside the coordinator's namespace."""
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

    def log_tail(self, lines: int = 60) -> str:
        text = self.coordinator_log.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def _start_coordinator(lab: Lab, tmp: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    """``fedshard coordinator`` in ``h0`` on its lab address; the process, its log, its token."""
    address = lab.plan.node(COORDINATOR_HOST).address
    log_path = tmp / "coordinator.log"
    command = [FEDSHARD, "coordinator", "--state-dir", str(tmp / "coordinator-state")]
    command += ["--interface", address, "--port", str(API_PORT)]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            lab.exec_argv(COORDINATOR_HOST, command),
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "400"},
        )
    deadline = time.monotonic() + 60
    while (match := re.search(r"console: http://\S+/\?token=(\S+)", _read(log_path))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"coordinator did not start:\n{_read(log_path)}")
        time.sleep(0.1)
    return proc, log_path, match.group(1)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _start_agent(lab: Lab, tmp: Path, host: str) -> AgentProc:
    """An unpaired agent in ``host``, bound to that host's lab address; waits until ready."""
    state = tmp / f"state-{host}"
    state.mkdir(parents=True, exist_ok=True)
    command = [PYTHON, "-m", "edge_agent", "agent", "--name", host, "--memory", AGENT_MEMORY]
    command += ["--state-dir", str(state), "--interface", lab.plan.node(host).address]
    log_path = tmp / f"{host}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            lab.exec_argv(host, command), cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT
        )
    agent = AgentProc(name=host, state_dir=state, proc=proc, log_path=log_path)
    deadline = time.monotonic() + 90
    while not (state / "agent.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_agent(agent)
            raise RuntimeError(f"agent {host} did not start:\n{agent.log()}")
        time.sleep(0.05)
    info = json.loads((state / "agent.json").read_text())
    agent.control_port, agent.data_port = info["control_port"], info["data_port"]
    return agent


def _start_agents(lab: Lab, tmp: Path) -> list[AgentProc]:
    """The three agents; the first one's measured profile is reused by the others."""
    started: list[AgentProc] = []
    try:
        for host in AGENT_HOSTS:
            if started:
                (tmp / f"state-{host}").mkdir(parents=True, exist_ok=True)
                profile = started[0].state_dir / "profile.json"
                shutil.copy(profile, tmp / f"state-{host}" / "profile.json")
            started.append(_start_agent(lab, tmp, host))
    except BaseException:
        for agent in started:
            stop_agent(agent)
        raise
    return started


def _pair(lab: CutLab) -> None:
    """Pair every agent the way an operator would: ``fedshard pair NAME CODE``."""

    def listed() -> bool:
        return set(AGENT_HOSTS) <= {d["name"] for d in lab.api.get("/v1/devices")}

    assert wait_for(listed, 60), lab.api.get("/v1/devices")
    for agent in lab.agents:
        result = lab.cli("pair", agent.name, pairing_code(agent))
        assert result.returncode == 0, result.stdout + result.stderr

    def paired() -> bool:
        devices: list[dict[str, Any]] = lab.api.get("/v1/devices")
        ready = [d["name"] for d in devices if d["status"] == "paired" and d["online"]]
        return len(ready) == len(AGENT_HOSTS)

    assert wait_for(paired, 30), lab.api.get("/v1/devices")
    hosts = {d["name"]: d["host"] for d in lab.api.get("/v1/devices")}
    assert hosts == {h: lab.lab.plan.node(h).address for h in AGENT_HOSTS}  # found across the lab


@pytest.fixture(scope="module")
def cut_lab(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CutLab]:
    pytest.importorskip("transformers")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    expected = unsharded_embeddings(model, SENTENCES)
    tmp = tmp_path_factory.mktemp("labcut")
    spec = LabSpec.build(1 + len(AGENT_HOSTS), agents=False)
    lab = Lab(spec, tmp / "lab")
    with lab:
        coordinator, log_path, token = _start_coordinator(lab, tmp)
        agents: list[AgentProc] = []
        api: NsApi | None = None
        try:
            address = lab.plan.node(COORDINATOR_HOST).address
            api = NsApi(lab, address, token)
            agents = _start_agents(lab, tmp)
            cut = CutLab(
                lab, tmp, coordinator, log_path, address, token, api, agents, model, expected
            )
            _pair(cut)
            yield cut
        finally:
            for name in AGENT_HOSTS:  # links up, so the agents can say goodbye as they stop
                _set_link(lab, name, "up")
            if api is not None:
                api.close()
            for agent in agents:
                stop_agent(agent)
            stop_process(coordinator)
    assert lab_netns(lab.plan.lab_id) == []


def _set_link(lab: Lab, host: str, state: str) -> None:
    """``ip link set`` the bridge port of ``host``'s veth (in the lab's ``ctl`` namespace)."""
    node = lab.plan.node(host)
    assert isinstance(node, HostPlan)
    run_command(["ip", "-n", lab.plan.control.netns, "link", "set", node.bridge_port, state])


def _link_back(lab: CutLab, host: str, cut_at: float) -> None:
    """Bring ``host``'s link up again, once the links' unacked-data timeout has passed since
    the cut: connections into the cut are then dropped and opened afresh, not reused."""
    time.sleep(max(0.0, cut_at + UNACKED_TIMEOUT_S + 2.0 - time.time()))
    _set_link(lab.lab, host, "up")


def _deploy(lab: CutLab, caps: tuple[int, ...]) -> dict[str, Any]:
    """``fedshard deploy`` of MiniLM under planning caps (MB, in :data:`AGENT_HOSTS` order)."""
    args = ["deploy", str(lab.model), "--name", MODEL_ID]
    for name, cap in zip(AGENT_HOSTS, caps, strict=True):
        args += ["--memory-cap", f"{name}={cap}MB"]
    result = lab.cli(*args)
    assert result.returncode == 0, result.stdout + result.stderr + lab.log_tail()
    version = _active(lab)
    assert len(version["segments"]) == 3, version
    return version


def _active(lab: CutLab) -> dict[str, Any]:
    [record] = [m for m in lab.api.get("/v1/deployments") if m["model_id"] == MODEL_ID]
    active: dict[str, Any] = next(
        v for v in record["versions"] if v["plan_version"] == record["active"]
    )
    return active


def _devices(version: dict[str, Any]) -> list[str]:
    return [p["device"] for p in version["segments"]]


def _events(lab: CutLab) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = lab.api.get("/v1/failover")["events"]
    return events


def _check(lab: CutLab, i: int, answer: Answer) -> int:
    """The plan version that answered request ``i`` correctly (fails the test otherwise)."""
    assert answer.status == 200, f"request {i}: {answer.status} {answer.detail}"
    assert answer.embedding is not None and answer.version is not None
    want = lab.expected[SENTENCES[i % len(SENTENCES)]]
    assert float(np.abs(answer.embedding - want).max()) < 1e-4, f"request {i} differs"
    return answer.version


@pytest.mark.timeout(600)
def test_link_cut_mid_stream_every_request_answered_once_and_correctly(
    cut_lab: CutLab, record_property: Any
) -> None:
    lab = cut_lab
    before = _deploy(lab, SPARE_CAPS)
    victim = before["segments"][1]["device"]  # the middle: requests inside it are stranded
    stream = Stream(lab.lab, lab.address, lab.token, TOTAL, IN_FLIGHT)
    try:
        assert wait_for(lambda: stream.answered() >= CUT_AFTER, 180), lab.log_tail()
        lab.cut["spare"] = victim, time.time()
        _set_link(lab.lab, victim, "down")
        assert stream.join(420), f"the stream hung: {stream.answered()} answered\n{lab.log_tail()}"
    finally:
        stream.stop()
    assert sorted(stream.answers) == list(range(TOTAL)), "some requests got no answer"
    versions = [_check(lab, i, stream.answers[i]) for i in range(TOTAL)]
    after = _active(lab)
    assert victim not in _devices(after) and len(_devices(after)) == 2, after
    assert after["trigger"].startswith("failover") and victim in after["trigger"]
    assert {before["plan_version"], after["plan_version"]} <= set(versions)
    events = _events(lab)
    [lost] = [e for e in events if e["kind"] == "lost" and e["device"] == victim]
    cut_at = lab.cut["spare"][1]
    assert lost["at"] >= cut_at
    assert any(
        e["kind"] == "replanned" and e["plan_version"] == after["plan_version"] for e in events
    ), events
    delay = lost["at"] - cut_at
    served = {v: versions.count(v) for v in sorted(set(versions))}
    record_property("detection_delay_s", round(delay, 3))
    record_property("answers_per_plan_version", served)
    log.warning("link cut of %s noticed after %.2f s (%s)", victim, delay, lost["detail"])
    log.warning("%d requests, per plan version: %s", TOTAL, served)


@pytest.mark.timeout(300)
def test_link_back_up_the_device_rejoins_and_the_plan_expands(cut_lab: CutLab) -> None:
    lab = cut_lab
    victim, cut_at = lab.cut["spare"]
    degraded = _active(lab)
    assert victim not in _devices(degraded)
    _link_back(lab, victim, cut_at)
    assert wait_for(lambda: len(_devices(_active(lab))) == 3, 180), _events(lab)
    expanded = _active(lab)
    assert victim in _devices(expanded) and expanded["trigger"] == f"expand: {victim} returned"

    def expanded_event() -> dict[str, Any] | None:  # recorded once old versions are unloaded
        return next((e for e in _events(lab) if e["kind"] == "expanded"), None)

    assert wait_for(lambda: expanded_event() is not None, 60), _events(lab)
    assert expanded_event()["plan_version"] == expanded["plan_version"]  # type: ignore[index]
    assert any(e["kind"] == "back" and e["device"] == victim for e in _events(lab))
    for text in SENTENCES:  # through the links to and from the returned device
        status, body, headers = lab.api.call(
            "POST", "/v1/embeddings", {"model": MODEL_ID, "input": text}
        )
        assert status == 200, body
        assert int(headers["x-fedshard-plan-version"]) == expanded["plan_version"]
        got = np.array(body["data"][0]["embedding"], dtype=np.float32)
        assert float(np.abs(got - lab.expected[text]).max()) < 1e-4, text


@pytest.mark.timeout(400)
def test_link_cut_when_the_rest_cannot_hold_it_requests_get_503_and_nothing_hangs(
    cut_lab: CutLab,
) -> None:
    lab = cut_lab
    big = AGENT_HOSTS[0]  # the 70 MB cap: 30 + 30 MB cannot hold the model
    version = _deploy(lab, TIGHT_CAPS)
    assert big in _devices(version)
    stream = Stream(lab.lab, lab.address, lab.token, 120, IN_FLIGHT)
    try:
        assert wait_for(lambda: stream.answered() >= 40, 180), lab.log_tail()
        lab.cut["tight"] = big, time.time()
        _set_link(lab.lab, big, "down")
        assert stream.join(300), f"the stream hung: {stream.answered()} answered\n{lab.log_tail()}"
    finally:
        stream.stop()
    assert sorted(stream.answers) == list(range(120)), "some requests got no answer"
    refused = 0
    for i in range(120):
        answer = stream.answers[i]
        if answer.status == 200:
            _check(lab, i, answer)
            continue
        assert answer.status == 503, f"request {i}: {answer.status} {answer.detail}"
        assert big in answer.detail["detail"], answer.detail
        refused += 1
    assert refused, "no request was refused after the cut"
    ask = {"model": MODEL_ID, "input": "after the cut"}
    status, body, headers = lab.api.call("POST", "/v1/embeddings", ask)
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, body)
    assert f"device {big} was lost" in body["detail"] and "cannot" in body["detail"], body
    assert lab.api.get("/v1/failover")["models"][MODEL_ID]["state"] == "unavailable"


@pytest.mark.timeout(300)
def test_link_back_up_the_unavailable_model_is_served_again(cut_lab: CutLab) -> None:
    lab = cut_lab
    big, cut_at = lab.cut["tight"]
    _link_back(lab, big, cut_at)

    ask = {"model": MODEL_ID, "input": SENTENCES[0]}
    assert wait_for(lambda: lab.api.call("POST", "/v1/embeddings", ask)[0] == 200, 180, 1.0)
    assert set(_devices(_active(lab))) == set(AGENT_HOSTS)
    status, body, _ = lab.api.call("POST", "/v1/embeddings", ask)
    assert status == 200, body
    got = np.array(body["data"][0]["embedding"], dtype=np.float32)
    assert float(np.abs(got - lab.expected[SENTENCES[0]]).max()) < 1e-4
    assert any(e["kind"] == "back" and e["device"] == big for e in _events(lab))
