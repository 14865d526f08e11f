"""Slow devices: the rule, the sampler's windows, the console snapshot, and a real slow device.

The unit tests run the rule and the sampler on plain numbers and the console's live snapshot on
canned agent metrics. The integration test (slow) starts a coordinator and three agents serving
MiniLM, steals one agent's CPU with busy loops pinned to its core, and checks that
``GET /v1/metrics`` names that device, and only that one, with the re-plan suggestion.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.console.slowness import (
    SlownessSampler,
    StageReading,
    StageWindow,
    find_slow,
)
from coordinator.console.stats import RequestStats
from coordinator.deploy.store import Placement, VersionRecord
from coordinator.http.console import LiveMetrics
from edge_agent.serve.metrics import AgentMetrics

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------- the rule


def _window(index: int, expected_ms: float, mean_ms: float, requests: int = 100) -> StageWindow:
    return StageWindow(
        index=index,
        device=f"dev{index}",
        expected_s=expected_ms / 1e3,
        compute_s=mean_ms / 1e3 * requests,
        requests=requests,
    )


def test_a_stage_slower_than_its_peers_relative_to_plan_is_flagged() -> None:
    # short requests: every stage runs at about 40 % of its predicted time, except stage 2
    windows = [_window(0, 10.0, 4.0), _window(1, 20.0, 8.4), _window(2, 10.0, 12.4)]
    [slow] = find_slow(windows)
    assert (slow.index, slow.device, slow.requests) == (2, "dev2", 100)
    assert slow.slowdown == pytest.approx(1.24 / 0.40, rel=1e-3)  # against the faster peer
    assert slow.measured_ms == pytest.approx(12.4)
    assert slow.expected_ms == pytest.approx(4.0)  # the prediction scaled like its peers
    assert slow.message.startswith("stage 3 on dev2 runs 3.1x slower than planned")
    assert "re-plan" in slow.message


def test_uniform_slowness_and_mild_differences_are_not_flagged() -> None:
    # every stage 3x its prediction (a busy shared host): nothing to gain from re-planning
    assert find_slow([_window(0, 10.0, 30.0), _window(1, 5.0, 15.0), _window(2, 8.0, 24.0)]) == []
    assert find_slow([_window(0, 10.0, 10.0), _window(1, 10.0, 19.0)]) == []


def test_too_few_samples_are_not_judged_and_a_lone_stage_uses_its_prediction() -> None:
    few = [_window(0, 10.0, 10.0), _window(1, 10.0, 50.0, requests=5)]
    assert find_slow(few) == []
    [lone] = find_slow([_window(0, 10.0, 25.0)])
    assert lone.slowdown == pytest.approx(2.5) and lone.expected_ms == pytest.approx(10.0)
    assert find_slow([_window(0, 10.0, 15.0)]) == []
    assert find_slow([_window(0, 0.0, 15.0)]) == []  # nothing planned to compare with


def test_slowest_first_when_two_of_three_are_slow() -> None:
    windows = [_window(0, 10.0, 10.0), _window(1, 10.0, 40.0), _window(2, 10.0, 90.0)]
    flagged = find_slow(windows)
    assert [s.index for s in flagged] == [2, 1]
    assert flagged[0].slowdown == pytest.approx(9.0) and flagged[1].slowdown == pytest.approx(4.0)


# ------------------------------------------------------------------------------ the sampler


def _reading(index: int, at: float, compute_s: float, requests: float, version: int = 1) -> Any:
    return StageReading(
        plan_version=version,
        index=index,
        device=f"dev{index}",
        expected_s=0.010,
        at=at,
        compute_s=compute_s,
        requests=requests,
    )


def _feed(sampler: SlownessSampler, at: float, per_stage_ms: list[float], n: float) -> list[Any]:
    """Cumulative counters as if each stage had computed ``n`` requests at these means."""
    return sampler.observe([_reading(i, at, ms / 1e3 * n, n) for i, ms in enumerate(per_stage_ms)])


def test_sampler_needs_a_long_enough_window() -> None:
    sampler = SlownessSampler(window_s=30.0, min_span_s=5.0, min_samples=30)
    assert _feed(sampler, 0.0, [10.0, 10.0, 40.0], 0) == []
    assert _feed(sampler, 3.0, [10.0, 10.0, 40.0], 300) == []  # 3 s is too short to judge
    [slow] = _feed(sampler, 6.0, [10.0, 10.0, 40.0], 600)
    assert slow.device == "dev2" and slow.slowdown == pytest.approx(4.0)


def test_sampler_window_forgets_what_is_older_than_the_window() -> None:
    sampler = SlownessSampler(window_s=10.0, min_span_s=2.0, min_samples=10)
    # 100 s of a normal device, then stage 1 turns 5x slower
    for t in range(0, 101, 2):
        assert _feed(sampler, float(t), [10.0, 10.0], 10.0 * t) == []
    compute = [10.0, 10.0]  # seconds so far: 1000 requests of 10 ms each
    flagged: list[Any] = []
    for t in range(102, 131, 2):
        compute = [compute[0] + 0.2, compute[1] + 1.0]  # 20 requests each: 10 ms and 50 ms
        flagged = sampler.observe(
            [_reading(i, float(t), c, 10.0 * t) for i, c in enumerate(compute)]
        )
    [slow] = flagged
    assert slow.device == "dev1" and slow.slowdown == pytest.approx(5.0)


def test_sampler_restarts_a_stage_whose_counters_went_back_and_each_version_alone() -> None:
    sampler = SlownessSampler(window_s=30.0, min_span_s=5.0, min_samples=30)
    _feed(sampler, 0.0, [10.0, 10.0], 0)
    assert len(_feed(sampler, 10.0, [10.0, 50.0], 500)) == 1
    # the agent of stage 1 restarted: its counters start again; its window starts again
    restarted = sampler.observe([_reading(0, 12.0, 6.0, 600), _reading(1, 12.0, 0.1, 10)])
    assert restarted == []
    # a new plan version is judged on its own readings only
    assert sampler.observe([_reading(0, 13.0, 1.0, 100, 2), _reading(1, 13.0, 1.0, 100, 2)]) == []


# --------------------------------------------------------------------- the console snapshot


def _placement(index: int, device: str, predicted_s: float, warmup_s: float) -> Placement:
    return Placement(
        index=index,
        device=device,
        host="127.0.0.1",
        control_port=1000 + index,
        data_port=2000 + index,
        sha256="0" * 64,
        param_bytes=1000,
        predicted_memory_bytes=5_000_000,
        predicted_compute_s=predicted_s,
        measured_memory_bytes=6_000_000,
        warmup_s=warmup_s,
        load_s=0.1,
    )


class _FakeAgents:
    """Agents' ``/metrics`` as text, with compute times the test sets."""

    def __init__(self) -> None:
        self.metrics_by_device: dict[str, AgentMetrics] = {}

    def observe(self, device: str, seconds: float, count: int) -> None:
        metrics = self.metrics_by_device.setdefault(device, AgentMetrics())
        for _ in range(count):
            metrics.compute_seconds.observe(seconds)

    def metrics(self, address: Any) -> str:
        return self.metrics_by_device.setdefault(address.device, AgentMetrics()).render().decode()


def test_live_snapshot_lists_the_slow_stage_with_a_what_if() -> None:
    version = VersionRecord(
        model_id="stack",
        version=3,
        plan_version=3,
        kind="encoder",
        state="active",
        created_at=0.0,
        source="/nowhere/model.onnx",
        objective="throughput",
        inputs=[],
        outputs=[],
        # the plan expects 2 ms and 4 ms; a noisy warm-up of stage 1 must not hide it
        segments=[_placement(0, "nas", 0.002, 0.003), _placement(1, "sbc", 0.004, 0.012)],
        health_max_abs_diff=0.0,
    )
    book = SimpleNamespace(models=[SimpleNamespace(model_id="stack", active=3)])
    store = SimpleNamespace(book=lambda: book, active=lambda model_id: version)
    agents = _FakeAgents()
    services: Any = SimpleNamespace(serving=SimpleNamespace(store=store), agents=agents)
    clock = [0.0]
    live = LiveMetrics(services, RequestStats(), clock=lambda: clock[0])
    assert live.snapshot(None).slow == []
    for _ in range(6):  # 12 s: longer than the shortest window judged
        agents.observe("nas", 0.004, 20)
        agents.observe("sbc", 0.028, 20)
        clock[0] += 2.0
        snap = live.snapshot("stack")
    [slow] = snap.slow
    assert slow.device == "sbc" and slow.index == 1 and slow.slowdown == pytest.approx(3.5)
    assert "stage 2 on sbc runs 3.5x slower than planned" in slow.message
    assert slow.what_if.model == "stack" and slow.what_if.drop == []
    assert slow.what_if.slowdown == {"sbc": pytest.approx(3.5)}
    assert [s.device for s in snap.stages] == ["nas", "sbc"]


# ------------------------------------------------------------------------ a real slow device

BASELINE_SECONDS = 15
"""Seconds of load before any CPU is stolen (nothing may be reported slow)."""
STEAL_SECONDS = 150.0
"""How long the integration test waits for the slow device to be reported."""
KEEP_WATCHING_SECONDS = 10
"""Once reported, the device must stay reported (and the only one) this long."""
BUSY_LOOPS = 6
"""Spinning processes on the victim's CPU: it keeps about a seventh of it."""


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (threads started later inherit it from their parent)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cpus)


@contextlib.contextmanager
def _busy_loops(cpu: int, count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes spinning on one CPU; always stopped."""
    loops: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            loops.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(loops[-1].pid, {cpu})
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(10)


def _drive(lab: Any, stop: threading.Event, failures: list[str]) -> None:
    from load_lab import embed

    with lab.coordinator.api(timeout=60.0) as api:
        while not stop.is_set():
            problem = embed(api, "Which train goes to the airport?")
            if problem is not None:
                failures.append(problem)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_device_whose_cpu_is_stolen_is_reported_slow(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from agent_helpers import minilm_model
    from load_lab import MODEL_ID, minilm_lab

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one to steal, one for the rest")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    with minilm_lab(tmp_path, model) as lab:
        with lab.coordinator.client() as api:
            segments = api.get(f"/v1/plan/{MODEL_ID}").json()["stages"]
        victim = segments[1]["device"]  # the middle stage
        stolen, rest = cpus[0], set(cpus[1:])
        stop, failures = threading.Event(), []
        drivers = [threading.Thread(target=_drive, args=(lab, stop, failures)) for _ in range(4)]
        before: list[list[dict[str, Any]]] = []
        after: list[list[dict[str, Any]]] = []
        try:
            for driver in drivers:
                driver.start()
            with lab.coordinator.client() as api:
                for _ in range(BASELINE_SECONDS):  # a fair share of CPU for all: nothing slow
                    time.sleep(1.0)
                    before.append(api.get("/v1/metrics").json()["slow"])
                for name, pid in lab.pids().items():  # the busy loops steal from one agent
                    _pin(pid, {stolen} if name == victim else rest)
                with _busy_loops(stolen, BUSY_LOOPS):
                    started = time.monotonic()
                    while time.monotonic() < started + STEAL_SECONDS and not any(after):
                        time.sleep(1.0)
                        after.append(api.get("/v1/metrics").json()["slow"])
                    detected = time.monotonic() - started
                    for _ in range(KEEP_WATCHING_SECONDS):  # it stays flagged, and alone
                        time.sleep(1.0)
                        after.append(api.get("/v1/metrics").json()["slow"])
        finally:
            stop.set()
            for driver in drivers:
                driver.join(60)
    log.info("reported after %.0f s of stolen CPU; then %s", detected, after[-1])
    assert failures == []
    assert before == [[]] * BASELINE_SECONDS
    flagged = [[s["device"] for s in snap] for snap in after if snap]
    assert flagged == [[victim]] * (KEEP_WATCHING_SECONDS + 1), after
    slow = after[-1][0]
    assert slow["slowdown"] >= 2.0 and slow["index"] == 1
    assert f"stage 2 on {victim} runs" in slow["message"] and "re-plan" in slow["message"]
    assert slow["what_if"] == {
        "model": MODEL_ID,
        "budgets": {},
        "drop": [],
        "slowdown": {victim: slow["slowdown"]},
        "objective": None,
    }
