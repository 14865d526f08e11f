"""JSON schemas: round trips, frozen models, unknown fields and bad references refused."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.devices import DeviceList
from protocols.errors import SchemaError
from protocols.manifest import Manifest
from protocols.plan import Objective, Plan, Stage
from protocols.problem import PlanningProblem

SHARED = Path(__file__).resolve().parents[3] / "shared" / "benchmarks" / "planner"
names = st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True)
sizes = st.integers(0, 2**40)


def requesters(draw: st.DrawFn, device_names: list[str]) -> dict[str, object] | None:
    """No requester, or one with links to a random subset of ``device_names``."""
    if not draw(st.booleans()):
        return None
    linked = draw(st.lists(st.sampled_from(device_names), unique=True))
    links = [
        {
            "device": name,
            "bandwidth_mbps": draw(st.floats(0.01, 1e5)),
            "latency_ms": draw(st.floats(0, 100)),
        }
        for name in linked
    ]
    return {"links": links}


@st.composite
def problems(draw: st.DrawFn) -> PlanningProblem:
    types = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    device_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    devices = [
        {
            "name": n,
            "type": draw(st.sampled_from(types)),
            "memory_bytes": draw(sizes),
            "bandwidth_mbps": draw(st.floats(0.1, 1e5)),
        }
        for n in device_names
    ]
    units = [
        {
            "name": f"u{i}",
            "weight_bytes": draw(sizes),
            "out_bytes": draw(sizes),
            "compute_s": {t: draw(st.floats(0, 10)) for t in types},
            "workspace_bytes": draw(sizes),
        }
        for i in range(draw(st.integers(1, 6)))
    ]
    links = []
    if len(device_names) >= 2 and draw(st.booleans()):
        links.append(
            {
                "a": device_names[0],
                "b": device_names[1],
                "bandwidth_mbps": draw(st.floats(0.1, 1e4)),
                "latency_ms": draw(st.floats(0, 100)),
            }
        )
    return PlanningProblem.from_obj(
        {
            "input_bytes": draw(sizes),
            "queue_depth": draw(st.integers(0, 4)),
            "units": units,
            "devices": devices,
            "links": links,
            "shared_weights": [{"name": "emb", "bytes": draw(sizes), "units": [0]}],
            "requester": requesters(draw, device_names),
        }
    )


@given(problems())
@settings(max_examples=100, deadline=None)
def test_problem_round_trip(problem: PlanningProblem) -> None:
    assert PlanningProblem.from_json(problem.to_json()) == problem


def test_shipped_benchmark_problems_parse() -> None:
    files = sorted(SHARED.glob("*.json"))
    if not files:
        pytest.skip(f"no shared benchmark problems at {SHARED}")
    for path in files:
        problem = PlanningProblem.from_json(path.read_text())
        assert len(problem.units) in (48, 96)


def _problem_dict() -> dict:
    return {
        "format": "fedshard.problem/1",
        "units": [{"name": "a", "weight_bytes": 1, "out_bytes": 1, "compute_s": {"cpu": 1.0}}],
        "devices": [{"name": "d", "type": "cpu", "memory_bytes": 10, "bandwidth_mbps": 100}],
    }


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="fedshard.problem/3"),
        lambda d: d["devices"][0].update(gflops=10.0),  # roofs need /2
        lambda d: d.update(surprise=1),
        lambda d: d["units"][0].pop("weight_bytes"),
        lambda d: d["units"][0].update(compute_s={"gpu": 1.0}),
        lambda d: d["units"][0].update(weight_bytes=-1),
        lambda d: d["devices"].append(dict(d["devices"][0])),
        lambda d: d.update(links=[{"a": "d", "b": "ghost", "bandwidth_mbps": 1}]),
        lambda d: d.update(shared_weights=[{"name": "e", "bytes": 1, "units": [7]}]),
        lambda d: d.update(units=[]),
        lambda d: d.update(requester={"links": [{"device": "ghost", "bandwidth_mbps": 1}]}),
        lambda d: d.update(requester={"links": [{"device": "d", "bandwidth_mbps": 1}] * 2}),
        lambda d: d.update(requester={"links": [{"device": "d", "bandwidth_mbps": 0}]}),
        lambda d: d.update(requester={"links": [], "surprise": 1}),
    ],
)
def test_bad_problems_raise_schema_error(mutate) -> None:
    doc = _problem_dict()
    mutate(doc)
    with pytest.raises(SchemaError):
        PlanningProblem.from_obj(doc)


def test_schema_error_on_broken_json() -> None:
    with pytest.raises(SchemaError):
        PlanningProblem.from_json("{not json")


def test_models_are_frozen() -> None:
    problem = PlanningProblem.from_obj(_problem_dict())
    with pytest.raises(pydantic.ValidationError):
        problem.queue_depth = 5  # type: ignore[misc]


def test_devices_json_contract() -> None:
    doc = {
        "devices": [
            {"name": "nas", "memory_bytes": 1 << 30, "gflops": 5, "bandwidth_mbps": 1000},
            {"name": "sbc", "memory_bytes": 1 << 29, "gflops": 2, "bandwidth_mbps": 100},
        ],
        "links": [{"a": "nas", "b": "sbc", "bandwidth_mbps": 90, "latency_ms": 1.5}],
    }
    devices = DeviceList.from_json(json.dumps(doc))
    assert DeviceList.from_json(devices.to_json()) == devices
    assert DeviceList.from_obj({"devices": doc["devices"]}).links == []
    with pytest.raises(SchemaError):
        DeviceList.from_obj({"devices": doc["devices"] * 2})
    with pytest.raises(SchemaError):
        DeviceList.from_obj({**doc, "links": doc["links"] * 2})
    with pytest.raises(SchemaError):
        DeviceList.from_obj({**doc, "links": [{"a": "nas", "b": "nas", "bandwidth_mbps": 1}]})
    requester = {"links": [{"device": "sbc", "bandwidth_mbps": 10, "latency_ms": 0.5}]}
    with_requester = DeviceList.from_obj({**doc, "requester": requester})
    assert with_requester.requester is not None
    assert with_requester.requester.links[0].device == "sbc"
    assert DeviceList.from_json(with_requester.to_json()) == with_requester
    for bad in ([{"device": "ghost", "bandwidth_mbps": 1}], requester["links"] * 2):
        with pytest.raises(SchemaError):
            DeviceList.from_obj({**doc, "requester": {"links": bad}})


def test_manifest_contract_round_trip_and_index_order() -> None:
    seg = {
        "index": 0,
        "device": "nas",
        "file": "segment-0.onnx",
        "sha256": "0" * 64,
        "inputs": ["input_ids"],
        "outputs": ["h"],
        "param_bytes": 10,
        "predicted_memory_bytes": 20,
        "predicted_compute_s": 0.5,
    }
    doc = {
        "format": "fedshard.manifest/1",
        "model": {
            "name": "m",
            "sha256": "1" * 64,
            "param_bytes": 10,
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 8]}],
            "outputs": [{"name": "h", "dtype": "float32", "shape": [None, 8, 4]}],
        },
        "objective": "throughput",
        "bottleneck_s": 0.5,
        "latency_s": 0.5,
        "segments": [seg],
    }
    manifest = Manifest.from_obj(doc)
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(SchemaError):
        Manifest.from_obj({**doc, "segments": [{**seg, "index": 1}]})
    with pytest.raises(SchemaError):
        Manifest.from_obj({**doc, "segments": [{**seg, "file": "../../etc/passwd"}]})


def test_plan_json_has_the_cli_contract_keys() -> None:
    plan = Plan.from_obj(
        {
            "objective": "latency",
            "bottleneck_s": 1.0,
            "latency_s": 2.0,
            "stages": [{"device": "a", "start": 0, "end": 3}],
        }
    )
    assert plan.input_transfer_s == 0.0  # older plans, without the field, still parse
    doc = json.loads(plan.to_json())
    assert {"objective", "bottleneck_s", "latency_s", "stages"} <= doc.keys()
    assert {"device", "start", "end"} <= doc["stages"][0].keys()


hexes = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
floats = st.floats(0, 1e6, allow_nan=False)


@st.composite
def device_lists(draw: st.DrawFn) -> DeviceList:
    device_names = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    devices = [
        {
            "name": n,
            "memory_bytes": draw(sizes),
            "gflops": draw(st.floats(0.01, 1e5)),
            "bandwidth_mbps": draw(st.floats(0.01, 1e5)),
        }
        for n in device_names
    ]
    links = [
        {"a": a, "b": b, "bandwidth_mbps": draw(st.floats(0.01, 1e5)), "latency_ms": draw(floats)}
        for a, b in itertools.pairwise(device_names)
        if draw(st.booleans())
    ]
    requester = requesters(draw, device_names)
    return DeviceList.from_obj({"devices": devices, "links": links, "requester": requester})


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    tensors = st.lists(
        st.fixed_dictionaries(
            {
                "name": names,
                "dtype": st.sampled_from(["float32", "int64"]),
                "shape": st.lists(st.none() | st.integers(0, 9) | names, max_size=4),
            }
        ),
        max_size=3,
    )
    segments = [
        {
            "index": i,
            "device": draw(names),
            "file": f"segment-{i}.onnx",
            "sha256": draw(hexes),
            "inputs": draw(st.lists(names, max_size=3)),
            "outputs": draw(st.lists(names, max_size=3)),
            "param_bytes": draw(sizes),
            "predicted_memory_bytes": draw(sizes),
            "predicted_compute_s": draw(floats),
            "units": (i, i + 1),
        }
        for i in range(draw(st.integers(1, 4)))
    ]
    return Manifest.from_obj(
        {
            "model": {
                "name": draw(names),
                "sha256": draw(hexes),
                "param_bytes": draw(sizes),
                "inputs": draw(tensors),
                "outputs": draw(tensors),
            },
            "objective": draw(st.sampled_from(["throughput", "latency"])),
            "bottleneck_s": draw(floats),
            "latency_s": draw(floats),
            "segments": segments,
        }
    )


plans = st.builds(
    Plan,
    objective=st.sampled_from(list(Objective)),
    bottleneck_s=floats,
    latency_s=floats,
    input_transfer_s=floats,
    stages=st.lists(
        st.builds(
            Stage,
            device=names,
            start=st.integers(0, 100),
            end=st.integers(0, 100),
            compute_s=floats,
            transfer_s=floats,
            memory_bytes=sizes,
        ),
        min_size=1,
        max_size=4,
    ),
)


@given(device_lists())
@settings(max_examples=100, deadline=None)
def test_devices_round_trip(devices: DeviceList) -> None:
    assert DeviceList.from_json(devices.to_json()) == devices


@given(manifests())
@settings(max_examples=100, deadline=None)
def test_manifest_round_trip(manifest: Manifest) -> None:
    assert Manifest.from_json(manifest.to_json()) == manifest


@given(plans)
@settings(max_examples=100, deadline=None)
def test_plan_round_trip(plan: Plan) -> None:
    assert Plan.from_json(plan.to_json()) == plan
