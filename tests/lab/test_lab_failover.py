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
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from agent_helpers import minilm_model
from coordinator_helpers import unsharded_embeddings, wait_for
from failover_helpers import active_version, failover_events, segment_devices
from lab_helpers import COORDINATOR_HOST, LabCluster, client_argv, lab_cluster

from devtools.lab.executor import lab_netns, run_command, unavailable_reason
from devtools.lab.lab import Lab
from devtools.lab.plan import HostPlan
from edge_agent.net.links import UNACKED_TIMEOUT_S

log = logging.getLogger(__name__)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(unavailable_reason()), reason=unavailable_reason() or "n/a"),
]

MODEL_ID = "all-minilm-l6-v2"
AGENT_HOSTS = ("h1", "h2", "h3")
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
    " ".join(["A long request fills the data-plane links with bigger activations."] * 4),
]
"""Short and long inputs: the long one (about 55 tokens) makes the largest frames, so the
frames stranded on a cut link fill its socket buffers. It stays within the 64-token sequence
the deployment under :data:`TIGHT_CAPS` is planned at, and within what every re-plan holds
(planned shapes are limits: a longer input is refused with 413, see test_shape_limits.py)."""


@dataclass
class Answer:
    """One request's outcome as the client inside the lab saw it."""

    status: int
    version: int | None
    embedding: np.ndarray | None
    detail: Any


class Stream:
    """``total`` embedding requests, ``in_flight`` at a time, from inside the coordinator's
    namespace (``lab_client.py stream``); answers fill in by request index as they arrive."""

    def __init__(self, cluster: LabCluster, total: int, in_flight: int) -> None:
        mode = ["stream", str(CLIENT_TIMEOUT_S), str(total), str(in_flight), MODEL_ID]
        self.answers: dict[int, Answer] = {}
        self._proc = cluster.lab.popen(
            COORDINATOR_HOST,
            client_argv(cluster.address, cluster.token, *mode, json.dumps(SENTENCES)),
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
    """The lab with its coordinator and agents, and what the answers must be."""

    cluster: LabCluster
    model: Path
    expected: dict[str, np.ndarray]
    cut: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Scenario -> the device whose link was cut, and the wall-clock time it was cut."""


@pytest.fixture(scope="module")
def cut_lab(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CutLab]:
    pytest.importorskip("transformers")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    expected = unsharded_embeddings(model, SENTENCES)
    tmp = tmp_path_factory.mktemp("labcut")
    unshaped = [None] * len(AGENT_HOSTS)
    with lab_cluster(tmp, unshaped, call_timeout_s=CLIENT_TIMEOUT_S) as cluster:
        try:
            hosts = {d["name"]: d["host"] for d in cluster.api.get("/v1/devices")}
            assert hosts == {h: cluster.lab.plan.node(h).address for h in AGENT_HOSTS}  # via mDNS
            yield CutLab(cluster, model, expected)
        finally:
            for name in AGENT_HOSTS:  # links up, so the agents can say goodbye as they stop
                _set_link(cluster.lab, name, "up")
    assert lab_netns(cluster.lab.plan.lab_id) == []


def _set_link(lab: Lab, host: str, state: str) -> None:
    """``ip link set`` the bridge port of ``host``'s veth (in the lab's ``ctl`` namespace)."""
    node = lab.plan.node(host)
    assert isinstance(node, HostPlan)
    run_command(["ip", "-n", lab.plan.control.netns, "link", "set", node.bridge_port, state])


def _link_back(lab: CutLab, host: str, cut_at: float) -> None:
    """Bring ``host``'s link up again, once the links' unacked-data timeout has passed since
    the cut: connections into the cut are then dropped and opened afresh, not reused."""
    time.sleep(max(0.0, cut_at + UNACKED_TIMEOUT_S + 2.0 - time.time()))
    _set_link(lab.cluster.lab, host, "up")


def _deploy(lab: CutLab, caps: tuple[int, ...]) -> dict[str, Any]:
    """``fedshard deploy`` of MiniLM under planning caps (MB, in :data:`AGENT_HOSTS` order)."""
    args = ["deploy", str(lab.model), "--name", MODEL_ID]
    for name, cap in zip(AGENT_HOSTS, caps, strict=True):
        args += ["--memory-cap", f"{name}={cap}MB"]
    result = lab.cluster.cli(*args)
    assert result.returncode == 0, result.stdout + result.stderr + lab.cluster.log_tail()
    version = _active(lab)
    assert len(version["segments"]) == 3, version
    return version


def _active(lab: CutLab) -> dict[str, Any]:
    return active_version(lab.cluster.api.get, MODEL_ID)


def _events(lab: CutLab) -> list[dict[str, Any]]:
    return failover_events(lab.cluster.api.get)


def _check(lab: CutLab, i: int, answer: Answer) -> int:
    """The plan version that answered request ``i`` correctly (fails the test otherwise)."""
    assert answer.status == 200, f"request {i}: {answer.status} {answer.detail}"
    assert answer.embedding is not None and answer.version is not None
    want = lab.expected[SENTENCES[i % len(SENTENCES)]]
    assert float(np.abs(answer.embedding - want).max()) < 1e-4, f"request {i} differs"
    return answer.version


def _stream_with_a_cut(
    lab: CutLab, scenario: str, victim: str, *, total: int, cut_after: int, join_s: float
) -> dict[int, Answer]:
    """Stream ``total`` requests, cut ``victim``'s link once ``cut_after`` are answered (noted
    in ``lab.cut[scenario]``), wait up to ``join_s`` for the rest; every request's answer."""
    stream = Stream(lab.cluster, total, IN_FLIGHT)
    try:
        assert wait_for(lambda: stream.answered() >= cut_after, 180), lab.cluster.log_tail()
        lab.cut[scenario] = victim, time.time()
        _set_link(lab.cluster.lab, victim, "down")
        assert stream.join(join_s), (
            f"the stream hung: {stream.answered()} answered\n{lab.cluster.log_tail()}"
        )
    finally:
        stream.stop()
    assert sorted(stream.answers) == list(range(total)), "some requests got no answer"
    return stream.answers


@pytest.mark.timeout(600)
def test_link_cut_mid_stream_every_request_answered_once_and_correctly(
    cut_lab: CutLab, record_property: Any
) -> None:
    lab = cut_lab
    before = _deploy(lab, SPARE_CAPS)
    victim = before["segments"][1]["device"]  # the middle: requests inside it are stranded
    answers = _stream_with_a_cut(lab, "spare", victim, total=TOTAL, cut_after=CUT_AFTER, join_s=420)
    versions = [_check(lab, i, answers[i]) for i in range(TOTAL)]
    after = _active(lab)
    assert victim not in segment_devices(after) and len(segment_devices(after)) == 2, after
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
    assert victim not in segment_devices(degraded)
    _link_back(lab, victim, cut_at)
    assert wait_for(lambda: len(segment_devices(_active(lab))) == 3, 180), _events(lab)
    expanded = _active(lab)
    assert (
        victim in segment_devices(expanded) and expanded["trigger"] == f"expand: {victim} returned"
    )

    def expanded_event() -> dict[str, Any] | None:  # recorded once old versions are unloaded
        return next((e for e in _events(lab) if e["kind"] == "expanded"), None)

    assert wait_for(lambda: expanded_event() is not None, 60), _events(lab)
    assert expanded_event()["plan_version"] == expanded["plan_version"]  # type: ignore[index]
    assert any(e["kind"] == "back" and e["device"] == victim for e in _events(lab))
    for text in SENTENCES:  # through the links to and from the returned device
        status, body, headers = lab.cluster.api.call(
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
    assert big in segment_devices(version)
    answers = _stream_with_a_cut(lab, "tight", big, total=120, cut_after=40, join_s=300)
    refused = 0
    for i in range(120):
        answer = answers[i]
        if answer.status == 200:
            _check(lab, i, answer)
            continue
        assert answer.status == 503, f"request {i}: {answer.status} {answer.detail}"
        assert big in answer.detail["error"]["message"], answer.detail
        refused += 1
    assert refused, "no request was refused after the cut"
    ask = {"model": MODEL_ID, "input": "after the cut"}
    status, body, headers = lab.cluster.api.call("POST", "/v1/embeddings", ask)
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, body)
    message = body["error"]["message"]
    assert f"device {big} was lost" in message and "cannot" in message, body
    assert lab.cluster.api.get("/v1/failover")["models"][MODEL_ID]["state"] == "unavailable"


@pytest.mark.timeout(300)
def test_link_back_up_the_unavailable_model_is_served_again(cut_lab: CutLab) -> None:
    lab = cut_lab
    big, cut_at = lab.cut["tight"]
    _link_back(lab, big, cut_at)

    ask = {"model": MODEL_ID, "input": SENTENCES[0]}
    assert wait_for(lambda: lab.cluster.api.call("POST", "/v1/embeddings", ask)[0] == 200, 180, 1.0)
    assert set(segment_devices(_active(lab))) == set(AGENT_HOSTS)
    status, body, _ = lab.cluster.api.call("POST", "/v1/embeddings", ask)
    assert status == 200, body
    got = np.array(body["data"][0]["embedding"], dtype=np.float32)
    assert float(np.abs(got - lab.expected[SENTENCES[0]]).max()) < 1e-4
    assert any(e["kind"] == "back" and e["device"] == big for e in _events(lab))
