"""The console's server side: request counters, stage rates, plan views and the routes.

The routes run in-process (FastAPI's TestClient) over a real pairing book, registry and
deployment store; the what-if plans a small real ONNX model with the partitioner.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

import onnx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from graph_helpers import block_stack
from pairing_helpers import request_code
from test_coordinator_api import _csr

from coordinator.commands import PLACEMENT_COLUMNS, placement_cells
from coordinator.console import ASSETS, asset_text
from coordinator.console.plans import deployed_view, what_if_devices
from coordinator.console.stages import Counters, StageSampler, StageTarget, parse_counters, rates
from coordinator.console.stats import InferenceCounter, RequestStats, percentile
from coordinator.deploy.store import DeploymentStore, Placement, VersionRecord, segment_dir
from coordinator.errors import AgentError, DeployError
from coordinator.fleet.links import LinkMeter
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.app import Services, create_app
from coordinator.http.serving import Serving
from coordinator.http.timing import RequestTimer
from coordinator.serving.embeddings import Embedder
from coordinator.transport.agent_client import AgentClient
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing
from edge_agent.serve.metrics import AgentMetrics
from protocols.devices import DeviceList
from protocols.links import Link
from protocols.plan import Objective
from protocols.profile import AgentState, Announcement, DeviceProfile

TOKEN = "console-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CAP = 3_300_000
"""Per-device memory that splits the test model (about 4.2 MB with runtime overhead) in three."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------ request counters


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_request_stats_rates_percentiles_and_window() -> None:
    clock = FakeClock()
    stats = RequestStats(window_s=30.0, rate_window_s=5.0, clock=clock)
    for k in range(20):
        stats.record(0.010 if k < 19 else 0.200, ok=k != 0)
        clock.now += 0.1
    snap = stats.snapshot()
    assert snap.requests_per_s == pytest.approx(20 / 5.0)
    assert snap.errors_per_s == pytest.approx(1 / 5.0)
    assert snap.latency_ms.p50 == pytest.approx(10.0)
    assert snap.latency_ms.p99 == pytest.approx(200.0)
    assert (snap.total, snap.errors) == (20, 1)
    clock.now += 10.0  # out of the rate window, still inside the percentile window
    later = stats.snapshot()
    assert later.requests_per_s == 0.0 and later.latency_ms.p50 == pytest.approx(10.0)
    clock.now += 60.0
    gone = stats.snapshot()
    assert gone.latency_ms.p50 is None and gone.total == 20


def _timed_app(stats: RequestStats) -> TestClient:
    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(fail: bool = False) -> dict[str, str]:
        if fail:
            from fastapi import HTTPException

            raise HTTPException(404, "no such model")
        return {"ok": "yes"}

    @app.post("/v1/other")
    def other() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(RequestTimer, observers=[InferenceCounter(stats)])
    return TestClient(app)


def test_the_inference_counter_counts_inference_posts_only() -> None:
    stats = RequestStats()
    client = _timed_app(stats)
    assert client.post("/v1/embeddings").status_code == 200
    assert client.post("/v1/embeddings?fail=true").status_code == 404
    assert client.post("/v1/other").status_code == 200
    assert client.get("/v1/embeddings").status_code == 405
    snap = stats.snapshot()
    assert (snap.total, snap.errors) == (2, 1)
    assert snap.latency_ms.p50 is not None and snap.latency_ms.p50 >= 0


# ----------------------------------------------------------------------------- stage rates


def _metrics_text(compute: list[float], send: list[float], idle: float) -> str:
    metrics = AgentMetrics()
    for value in compute:
        metrics.compute_seconds.observe(value)
        metrics.requests.labels("ok").inc()
    for value in send:
        metrics.send_seconds.observe(value)
    metrics.idle_seconds.inc(idle)
    metrics.bytes_out.inc(2_000_000)
    metrics.queue_depth.labels("compute").set(2)
    metrics.queue_depth.labels("send").set(1)
    return metrics.render().decode()


def test_parse_counters_reads_an_agents_exposition() -> None:
    counters = parse_counters(_metrics_text([0.1, 0.3], [0.05], idle=1.5), at=5.0)
    assert counters.compute_s == pytest.approx(0.4)
    assert counters.compute_count == 2
    assert counters.send_s == pytest.approx(0.05) and counters.send_count == 1
    assert counters.requests == 2 and counters.bytes_out == 2_000_000
    assert (counters.compute_queue, counters.send_queue) == (2, 1)
    assert counters.resident_bytes > 0
    with pytest.raises(ValueError):
        parse_counters("fedshard_compute_seconds_sum{ nonsense", at=0.0)


def test_rates_between_two_scrapes() -> None:
    before = Counters(at=10.0, compute_s=1.0, compute_count=10, send_s=0.2, send_count=10)
    now = Counters(
        at=12.0, compute_s=1.5, compute_count=30, send_s=0.3, send_count=30, bytes_out=4e6
    )
    r = rates(1, "laptop", before, now)
    assert r.compute_share == pytest.approx(0.25)
    assert r.idle_share == pytest.approx(0.75)
    assert r.send_share == pytest.approx(0.05)
    assert r.requests_per_s == pytest.approx(10.0)
    assert r.mean_compute_ms == pytest.approx(25.0)
    assert r.mean_send_ms == pytest.approx(5.0)
    assert r.sent_mb_per_s == pytest.approx(2.0)
    first = rates(1, "laptop", None, now)
    assert first.compute_share is None and first.queued == 0
    restarted = rates(1, "laptop", now, before.__class__(at=13.0, compute_count=1))
    assert restarted.compute_share is None


def test_stage_sampler_keeps_the_last_scrape_and_reports_failures() -> None:
    clock = FakeClock()
    texts = iter([_metrics_text([0.1], [], 0.0), _metrics_text([0.1, 0.2, 0.3], [], 0.0)])

    def down() -> str:
        raise AgentError("sbc (127.0.0.1:1): connection refused")

    sampler = StageSampler(clock)
    targets = [StageTarget(0, "nas", lambda: next(texts)), StageTarget(1, "sbc", down)]
    first = sampler.sample(targets)
    assert first[0].compute_share is None and first[1].error is not None
    assert "connection refused" in first[1].error
    clock.now += 2.0
    second = sampler.sample(targets[:1])
    assert second[0].compute_share == pytest.approx(0.5 / 2.0)
    assert second[0].requests_per_s == pytest.approx(1.0)


# ------------------------------------------------------------------------------ plan views


def _placement(index: int, device: str, measured_s: float) -> Placement:
    return Placement(
        index=index,
        device=device,
        host="127.0.0.1",
        control_port=1000 + index,
        data_port=2000 + index,
        sha256="0" * 64,
        param_bytes=1000,
        predicted_memory_bytes=5_000_000,
        predicted_compute_s=0.002,
        measured_memory_bytes=6_000_000,
        warmup_s=measured_s,
        load_s=0.1,
    )


def _version(source: Path, devices: list[str], times: list[float]) -> VersionRecord:
    return VersionRecord(
        model_id="stack",
        version=1,
        plan_version=1,
        kind="encoder",
        state="active",
        created_at=0.0,
        source=str(source),
        objective=Objective.THROUGHPUT,
        inputs=[],
        outputs=[],
        segments=[_placement(k, d, t) for k, (d, t) in enumerate(zip(devices, times, strict=True))],
        health_max_abs_diff=0.0,
    )


def test_deployed_view_marks_the_slowest_measured_stage() -> None:
    version = _version(Path("/nowhere.onnx"), ["a", "b", "c"], [0.002, 0.009, 0.004])
    view = deployed_view(version, None, {"a": 10**8, "b": 2 * 10**8})
    assert [s.bottleneck for s in view.stages] == [False, True, False]
    assert view.bottleneck_index == 1 and view.bottleneck_basis == "measured"
    assert [s.budget_bytes for s in view.stages] == [10**8, 2 * 10**8, None]
    assert view.stages[0].unit_start is None and view.total_units is None


def test_deployed_view_carries_the_kv_reserve_apart_from_what_loading_takes() -> None:
    version = _version(Path("/nowhere.onnx"), ["a"], [0.002])
    reserved = version.model_copy(
        update={"segments": [version.segments[0].model_copy(update={"state_bytes": 1_500_000})]}
    )
    (stage,) = deployed_view(reserved, None, {}).stages
    assert (stage.predicted_memory_bytes, stage.state_bytes) == (5_000_000, 1_500_000)
    (old,) = deployed_view(version, None, {}).stages
    assert old.state_bytes == 0, "records that predate the field reserve nothing"
    cells = dict(
        zip(PLACEMENT_COLUMNS, placement_cells(reserved.segments[0].model_dump()), strict=True)
    )
    assert (cells["pred. MB"], cells["KV MB"], cells["meas. MB"]) == ("3.5", "1.5", "6.0")
    assert cells["MB pred./meas."] == "0.58" and cells["ms pred./meas."] == "1.00"


def test_what_if_devices_checks_names_and_drops() -> None:
    profiles = {"a": (100, 10.0), "b": (200, 20.0)}
    links = [Link(a="a", b="b", bandwidth_mbps=100.0, latency_ms=1.0)]
    devices = what_if_devices(profiles, links, {"a": 50}, ["b"])
    assert [(d.name, d.memory_bytes, d.gflops) for d in devices.devices] == [("a", 50, 10.0)]
    assert devices.links == []
    assert len(what_if_devices(profiles, links, {}, []).links) == 1
    with pytest.raises(DeployError, match="not paired and online: c"):
        what_if_devices(profiles, links, {"c": 1}, [])
    with pytest.raises(DeployError, match="every device was dropped"):
        what_if_devices(profiles, links, {}, ["a", "b"])


def test_what_if_devices_price_by_the_roofs_and_a_measured_slowdown() -> None:
    profiles = {"a": (100, 10.0), "b": (200, 20.0)}
    roofs = {"b": {"memory_gbps": 4.0, "op_us": 1.0, "call_us": 8.0, "topk_ns": 3.0}}
    devices = what_if_devices(profiles, [], {}, [], (), roofs, {"b": 2.0})
    a, b = devices.devices
    assert (a.gflops, a.memory_gbps) == (10.0, None)
    assert (b.gflops, b.memory_gbps, b.op_us, b.call_us, b.topk_ns) == (10.0, 2.0, 2.0, 16.0, 6.0)
    with pytest.raises(DeployError, match="not paired and online: c"):
        what_if_devices(profiles, [], {}, [], (), roofs, {"c": 2.0})


# ---------------------------------------------------------------------------------- routes


def _pair(services: Services, name: str, memory: int) -> None:
    code = request_code(services.pairing, name, _csr())
    device = services.pairing.approve(name, code)
    profile = DeviceProfile(
        device_id="ab" * 8,
        name=name,
        memory_bytes=memory,
        gflops=20.0,
        control_port=9,
        data_port=10,
        cert_fingerprint=device.fingerprint,
    )
    announcement = Announcement(profile=profile, state=AgentState(paired=True))
    services.registry.announce(announcement, "127.0.0.1", f"{name}._fedshard._tcp.local.")


@pytest.fixture
def deployed(tmp_path: Path) -> tuple[TestClient, Services]:
    """A coordinator app with three paired devices and a 3-stage split of a real model."""
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model

    source = tmp_path / "stack.onnx"
    onnx.save(block_stack(6, width=128), source)
    ctx = ssl.create_default_context()
    agents = AgentClient(ctx)
    store = DeploymentStore(tmp_path)
    links = LinkMeter(agents, lambda: [])
    serving = Serving(store, None, None, Embedder(store, None), links)  # type: ignore[arg-type]
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
        serving=serving,
        agents=agents,
        state_dir=tmp_path,
    )
    for name in ("a", "b", "c"):
        _pair(services, name, 10**9)
    caps = DeviceList.from_obj(
        {
            "devices": [
                {"name": n, "memory_bytes": CAP, "gflops": 20.0, "bandwidth_mbps": 1000.0}
                for n in "abc"
            ]
        }
    )
    out = segment_dir(tmp_path, "stack", 1)
    split = split_model(source, caps, out, SplitOptions())
    assert len(split.manifest.segments) == 3
    version = _version(source, [s.device for s in split.manifest.segments], [0.001, 0.003, 0.002])
    store.activate(version, None)
    return TestClient(create_app(services)), services


def test_console_routes_need_the_token(deployed: tuple[TestClient, Services]) -> None:
    client, _ = deployed
    for path in ("/v1/console/models", "/v1/plan/stack", "/v1/metrics", "/v1/metrics/stream"):
        assert client.get(path).status_code == 401
    assert client.post("/v1/plan/what-if", json={"model": "stack"}).status_code == 401


def test_plan_route_shows_units_memory_and_the_bottleneck(
    deployed: tuple[TestClient, Services],
) -> None:
    client, _ = deployed
    [model] = client.get("/v1/console/models", headers=AUTH).json()
    assert model == {
        "model_id": "stack",
        "kind": "encoder",
        "active": 1,
        "previous": None,
        "speculative": "off",  # an encoder does not generate
        "speculation_off": None,
        "speculation_in_effect": None,
        "draft_model": None,
        "acceptance_rate": None,
        "tokens_per_s": None,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "gguf": None,  # deployed from an ONNX file, not a GGUF
    }
    view = client.get("/v1/plan/stack", headers=AUTH).json()
    stages = view["stages"]
    assert len(stages) == 3 and view["total_units"] == stages[-1]["unit_end"]
    assert [s["unit_start"] for s in stages[1:]] == [s["unit_end"] for s in stages[:-1]]
    assert all(s["first_unit"] and s["budget_bytes"] == 10**9 for s in stages)
    assert [s["bottleneck"] for s in stages] == [False, True, False]
    assert client.get("/v1/plan/nope", headers=AUTH).status_code == 404
    missing = client.get("/v1/plan/stack?version=9", headers=AUTH)
    assert missing.status_code == 400 and "no version 9" in missing.json()["detail"]


def test_what_if_replans_without_deploying(deployed: tuple[TestClient, Services]) -> None:
    client, services = deployed
    book_before = services.serving.store.book()  # type: ignore[union-attr]
    answer = client.post(
        "/v1/plan/what-if",
        json={"model": "stack", "budgets": {"a": 10**8}, "drop": ["b", "c"]},
        headers=AUTH,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    [alone] = body["what_if"]["stages"]
    assert alone["device"] == "a" and alone["budget_bytes"] == 10**8 and alone["bottleneck"]
    assert (alone["unit_start"], alone["unit_end"]) == (0, body["what_if"]["total_units"])
    assert body["what_if"]["plan_version"] is None and len(body["current"]["stages"]) == 3
    assert services.serving.store.book() == book_before  # type: ignore[union-attr]
    two = client.post(
        "/v1/plan/what-if",
        json={"model": "stack", "budgets": {"a": CAP, "b": CAP}, "drop": ["c"]},
        headers=AUTH,
    )
    assert two.status_code == 409 and "no plan fits" in two.json()["detail"]
    assert "Traceback" not in two.text
    unknown = client.post("/v1/plan/what-if", json={"model": "stack", "drop": ["zz"]}, headers=AUTH)
    assert unknown.status_code == 409 and "zz" in unknown.json()["detail"]


def test_metrics_stream_sends_snapshots(deployed: tuple[TestClient, Services]) -> None:
    client, services = deployed
    client.post("/v1/embeddings", json={"model": "nope", "input": "x"}, headers=AUTH)
    with client.stream(
        "GET", "/v1/metrics/stream?model=stack&interval=0.25", headers=AUTH
    ) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events: list[str] = []
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 2:
                break
    import json

    snap = json.loads(events[0])
    assert snap["model_id"] == "stack" and snap["plan_version"] == 1
    assert snap["requests"]["total"] == 1 and snap["requests"]["errors"] == 1
    placed = [p.device for p in services.serving.store.active("stack").segments]  # type: ignore[union-attr]
    assert [s["device"] for s in snap["stages"]] == placed
    assert all(s["error"] for s in snap["stages"])  # no agent listens: said in plain words
    assert client.get("/v1/metrics/stream?model=nope", headers=AUTH).status_code == 404


def test_console_page_and_assets_are_packaged_and_self_contained() -> None:
    page = asset_text("index.html")
    referenced = set(re.findall(r'(?:src|href)="/console/([^"]+)"', page))
    assert referenced == set(ASSETS)
    for text in [page, *(asset_text(name) for name in ASSETS)]:
        assert not re.search(r"(?:src|href)=\"https?://", text)
        assert "cdn" not in text.lower()
    for tag in re.findall(r"<(?:input|select|textarea)\b[^>]*>", page):
        ident = re.search(r'id="([^"]+)"', tag)
        assert ident, tag
        labelled = f'for="{ident.group(1)}"' in page or "aria-label" in tag
        assert labelled, f"input without a label: {tag}"


def test_console_is_served_with_a_strict_policy(tmp_path: Path) -> None:
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
    )
    client = TestClient(create_app(services))
    page = client.get("/")
    assert page.status_code == 200 and "fedshard coordinator" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["referrer-policy"] == "no-referrer"
    for name, kind in ASSETS.items():
        asset = client.get(f"/console/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"] == kind
    assert client.get("/console/../api.py").status_code == 404
    assert client.get("/console/secret.js").status_code == 404
