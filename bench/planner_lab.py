"""Planner in the LAN lab: the optimal plan against exo-style and even splits, on a real network.

A lab (``tests/lab_helpers.py``): ``fedshard coordinator`` in ``h0``, agents in ``h1``-``h3``,
paired over real mDNS. ``h3`` has the most memory but a slow link (``tbf`` both ways); the
planning caps give the three devices different budgets. The model is all-MiniLM-L6-v2 with
its sample inputs set to the request the bench sends (batch 1 x 128 tokens), so the coordinator
plans for exactly that traffic. The coordinator measures the links once (``POST
/v1/links/measure``); then the same model is deployed three ways through ``POST
/v1/deployments``: the coordinator's plan (throughput objective), an even split and exo's
memory-weighted split (the ``baseline`` field). For each, from a client inside ``h0``:

- predicted (the plan the coordinator wrote, re-scored with the same links) against measured:
  latency one request at a time, throughput with requests in flight;
- per stage, predicted compute and transfer against what the agents measured
  (``GET /v1/metrics``: mean compute and send time per request, both phases).

    .venv/bin/python bench/planner_lab.py [--slow-mbps 10] [--caps 70,60,120] [--requests 100]

Needs root (network namespaces); without it, says so and exits 0. Writes
bench/results/planner_lab.md, .json and .png. The lab is removed however the run ends.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from _planner_lab_report import (  # noqa: E402
    MB,
    STRATEGIES,
    TOKENS,
    Outcome,
    report,
)
from agent_helpers import minilm_model  # noqa: E402
from lab_helpers import LabCluster, lab_cluster  # noqa: E402

from coordinator.deploy.store import segment_dir  # noqa: E402
from devtools.lab.executor import unavailable_reason  # noqa: E402
from partitioner.cutting.inputs import Analysis  # noqa: E402
from protocols.devices import DeviceList  # noqa: E402
from protocols.plan import Objective, Plan  # noqa: E402
from protocols.roofs import ROOF_FIELD_NAMES  # noqa: E402

CACHE = REPO / ".pytest_cache" / "d" / "fedshard-minilm"
MODEL_ID = "all-minilm-l6-v2"
OBJECTIVES = {"optimal": Objective.THROUGHPUT, "latency-optimal": Objective.LATENCY}
"""The coordinator's own plans, by the objective they were made for; the rest are baselines."""
WORDS = [
    "the",
    "devices",
    "of",
    "a",
    "local",
    "network",
    "share",
    "one",
    "model",
    "and",
    "hand",
    "activations",
    "along",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-mbps", type=float, default=10.0, help="h3's link rate")
    parser.add_argument("--caps", default="70,60,120", help="planning caps of h1,h2,h3 in MB")
    parser.add_argument("--requests", type=int, default=100, help="pipelined requests per plan")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--latency-runs", type=int, default=20)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"planner_lab: skipped: {reason}")
        return 0
    CACHE.mkdir(parents=True, exist_ok=True)
    base = minilm_model(CACHE)
    caps = dict(zip(("h1", "h2", "h3"), (int(c) * MB for c in args.caps.split(",")), strict=True))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="planner-lab-") as tmp_name:
        tmp = Path(tmp_name)
        text, feeds = request_text()
        model = with_samples(base, feeds, tmp / "minilm-1x128.onnx")
        analysis = analyse_model(model)
        rates = (None, None, args.slow_mbps)
        with lab_cluster(tmp, rates, lambda step: print(f"planner_lab: {step}")) as cluster:
            api = cluster.api.client()
            links = [link.model_dump(mode="json") for link in api.measure_links(timeout=120)]
            requester = [link.model_dump(mode="json") for link in api.requester_links()]
            devices = lab_devices(cluster, caps, links, requester)
            single = best_single(analysis, devices)
            alone = {name: cap if name == single else 0 for name, cap in caps.items()}
            paper = {s: paper_plan(analysis, devices, s, single) for s in STRATEGIES}
            outcomes = [
                measure(
                    cluster,
                    s,
                    model,
                    text,
                    alone if s == "single" else caps,
                    args,
                    analysis,
                    devices,
                )
                for s in STRATEGIES
            ]
    wall = time.monotonic() - started
    report(args, links, devices, paper, outcomes, wall)
    return 0


def request_text() -> tuple[str, dict[str, Any]]:
    """A sentence the model's tokenizer makes exactly :data:`TOKENS` tokens of, and its feeds."""
    from coordinator.serving.embeddings import TextEncoder, default_tokenizer_dir

    directory = default_tokenizer_dir(MODEL_ID)
    if directory is None:
        raise RuntimeError("the MiniLM tokenizer package is not installed")
    encoder = TextEncoder(Path(directory))
    words: list[str] = []
    while True:
        feeds, _ = encoder.encode([" ".join([*words, WORDS[len(words) % len(WORDS)]])])
        if feeds["input_ids"].shape[1] > TOKENS:
            break
        words.append(WORDS[len(words) % len(WORDS)])
    text = " ".join(words)
    feeds, _ = encoder.encode([text])
    if feeds["input_ids"].shape != (1, TOKENS):
        raise RuntimeError(f"the request text makes {feeds['input_ids'].shape} tokens")
    return text, dict(feeds)


def with_samples(model: Path, feeds: dict[str, Any], out: Path) -> Path:
    """A copy of ``model`` whose embedded sample inputs are ``feeds``: the coordinator plans,
    warms up and health-checks at the shape of the bench's requests."""
    import onnx

    from partitioner.analysis.samples import SAMPLE_INPUTS_KEY, encode_samples

    proto = onnx.load(str(model))
    kept = [p for p in proto.metadata_props if p.key != SAMPLE_INPUTS_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    entry = proto.metadata_props.add()
    entry.key, entry.value = SAMPLE_INPUTS_KEY, encode_samples(feeds)
    onnx.save(proto, str(out))
    return out


def analyse_model(model: Path) -> Analysis:
    """The partitioner's analysis of the model, as the coordinator's deploy makes it."""
    from partitioner.analysis.modelio import load_model
    from partitioner.cutting.split import analyse

    return analyse(load_model(model))


def lab_devices(
    cluster: LabCluster,
    caps: dict[str, int],
    links: list[dict[str, Any]],
    requester: list[dict[str, Any]],
) -> DeviceList:
    """What the coordinator's planner sees: capped memory, announced GFLOP/s, measured links
    between the agents and from the coordinator to each, devices in the coordinator's order."""
    found = {
        d.name: d.announcement.profile.model_dump(mode="json")
        for d in cluster.api.client().devices()
    }
    devices = [
        {
            "name": name,
            "memory_bytes": min(caps[name], found[name]["memory_bytes"]),
            "gflops": found[name]["gflops"],
            "bandwidth_mbps": 1000.0,
            # the roofs the coordinator plans with (announced), so paper plans are its plans
            **{k: found[name][k] for k in ROOF_FIELD_NAMES if found[name].get(k) is not None},
        }
        for name in found
        if name in caps
    ]
    to_devices = [link for link in requester if link["device"] in caps]
    return DeviceList.from_obj(
        {"devices": devices, "links": links, "requester": {"links": to_devices}}
    )


def problem_of(analysis: Analysis, devices: DeviceList) -> Any:
    """The planning problem a deploy builds (same options as the coordinator's split)."""
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import planning_problem

    return planning_problem(analysis, devices, SplitOptions(), MODEL_ID)


def best_single(analysis: Analysis, devices: DeviceList) -> str:
    """The device that alone serves the model best on paper (throughput), among those whose
    planning cap holds it."""
    from partitioner.errors import InfeasiblePlanError
    from partitioner.planning.planner import plan

    best: tuple[float, str] | None = None
    for device in devices.devices:
        alone = _only(devices, device.name)
        try:
            chosen = plan(problem_of(analysis, alone), Objective.THROUGHPUT)
        except InfeasiblePlanError:
            continue
        if best is None or chosen.bottleneck_s < best[0]:
            best = (chosen.bottleneck_s, device.name)
    if best is None:
        raise RuntimeError("no single device's cap holds the model: raise one cap (--caps)")
    return best[1]


def _only(devices: DeviceList, name: str) -> DeviceList:
    """``devices`` with every other device's memory set to 0."""
    kept = [
        d if d.name == name else d.model_copy(update={"memory_bytes": 0}) for d in devices.devices
    ]
    return devices.model_copy(update={"devices": kept})


def paper_plan(analysis: Analysis, devices: DeviceList, strategy: str, single: str) -> Plan:
    """What ``strategy`` gives on paper with the lab's devices and measured links."""
    from partitioner.planning.baselines import Baseline, run_baseline
    from partitioner.planning.planner import plan_preferring_one_device as plan

    if strategy == "single":
        devices = _only(devices, single)
        strategy = "optimal"
    problem = problem_of(analysis, devices)
    if strategy in OBJECTIVES:
        return plan(problem, OBJECTIVES[strategy])
    return run_baseline(problem, Objective.THROUGHPUT, Baseline(strategy)).plan


def rescore(analysis: Analysis, devices: DeviceList, manifest: Any, objective: Objective) -> Plan:
    """The deployed arrangement scored with the lab's links: per-stage compute and transfer."""
    from partitioner.planning.semantics import evaluate

    stages = [(s.device, s.units[0], s.units[1]) for s in manifest.segments]
    return evaluate(problem_of(analysis, devices), objective, stages)


def measure(
    cluster: LabCluster,
    strategy: str,
    model: Path,
    text: str,
    caps: dict[str, int],
    args: argparse.Namespace,
    analysis: Analysis,
    devices: DeviceList,
) -> Outcome:
    """Deploy ``strategy``, then time requests one at a time and with several in flight."""
    from protocols.manifest import MANIFEST_FILE, Manifest

    print(f"planner_lab: deploying the {strategy} split")
    body: dict[str, Any] = {"model_path": str(model), "model_id": MODEL_ID, "memory_caps": caps}
    objective = OBJECTIVES.get(strategy, Objective.THROUGHPUT)
    body["objective"] = objective.value
    if strategy not in (*OBJECTIVES, "single"):
        body["baseline"] = strategy
    start = time.monotonic()
    record = cluster.api.client().deploy(body, timeout=900)
    deploy_s = time.monotonic() - start
    version = record.plan_version
    path = segment_dir(cluster.state_dir, MODEL_ID, version) / MANIFEST_FILE
    manifest = Manifest.from_json(path.read_bytes())
    ask = {"model": MODEL_ID, "input": text}
    cluster.api.load("/v1/embeddings", ask, 8, 4)  # warm the coordinator's chain connections
    cluster.api.client().live_metrics(MODEL_ID)
    print(f"planner_lab: {strategy}: {args.latency_runs} requests one at a time")
    sequential = cluster.api.load("/v1/embeddings", ask, args.latency_runs, 1)
    stages_sequential = _stages(cluster)
    print(f"planner_lab: {strategy}: {args.requests} requests, {args.in_flight} in flight")
    pipelined = cluster.api.load("/v1/embeddings", ask, args.requests, args.in_flight)
    stages_pipelined = _stages(cluster)
    return Outcome(
        strategy=strategy,
        plan_version=version,
        predicted=rescore(analysis, devices, manifest, objective),
        manifest_bottleneck_s=manifest.bottleneck_s,
        manifest_latency_s=manifest.latency_s,
        sequential=sequential,
        pipelined=pipelined,
        stages_sequential=stages_sequential,
        stages_pipelined=stages_pipelined,
        deploy_s=deploy_s,
        placements=_placements(cluster, version),
    )


def _placements(cluster: LabCluster, version: int) -> list[dict[str, Any]]:
    """The deployed version's segments as the coordinator records them."""
    record = cluster.api.client().deployment(MODEL_ID)
    [deployed] = [v for v in record.versions if v.plan_version == version]
    segments = sorted(deployed.segments, key=lambda p: p.index)
    return [p.model_dump(mode="json") for p in segments]


def _stages(cluster: LabCluster) -> list[dict[str, Any]]:
    time.sleep(0.6)  # the console shares snapshots under half a second old
    snapshot = cluster.api.client().live_metrics(MODEL_ID)
    return [stage.model_dump(mode="json") for stage in snapshot.stages]


if __name__ == "__main__":
    sys.exit(main())
