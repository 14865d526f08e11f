"""Predicted memory against what the agent really keeps resident, segment by segment.

MiniLM is split for three devices whose budgets are 60%, 30% and 30% of its weights plus the
runtime memory the partitioner's model says a stage needs, costed at the deployment's shapes
(batch 1 x 128 tokens). Each segment is then deployed through the agent's own
:class:`~edge_agent.runtime.segments.SegmentStore` (hash, signature, budget, load, warm-up at
1 x 128, measure), each in a fresh process so one segment's heap does not blur another's, with the
device's budget from the split. The prediction must cover what was measured, and not by much.

Run as a script (``python tests/e2e/test_memory_truth.py SPLIT_DIR INDEX WARMUP.npz BUDGET``) it
is that fresh process: it prints the agent's deploy report as JSON.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY_DIMS = {"batch": 1, "sequence": 128}
SLACK = 1.5
"""Predicted memory may exceed the measured resident memory by at most this factor."""


SERVED_REQUESTS = 100


def deploy_in_this_process(split_dir: Path, index: int, warmup: Path, budget: int) -> str:
    """Deploy segment ``index`` of a split into a real segment store, then serve
    :data:`SERVED_REQUESTS` requests (each decoded from its own frame, as on the data plane).

    Returns JSON: the deploy report and ``serving_bytes``, the resident memory added once the
    requests are done (freed heap returned to the OS, as the agent does after warm-up).
    """
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from coordinator.deploy.plan import forward_names
    from edge_agent.config import RuntimeConfig
    from edge_agent.runtime.engine import prime, release_freed_heap, resident_bytes
    from edge_agent.runtime.segments import SegmentStore
    from edge_agent.trust.identity import Identity
    from protocols.deploy import DeployManifest, DeployRequest, Hop, signing_bytes
    from protocols.frames import FrameHeader, decode_frame, encode_frame
    from protocols.manifest import Manifest

    manifest = Manifest.from_json((split_dir / "manifest.json").read_text())
    entry = manifest.segments[index]
    key = ed25519.Ed25519PrivateKey.generate()
    identity = Identity(
        name=entry.device,
        device_id="0" * 32,
        cert_fingerprint="0" * 64,
        paired=True,
        cert_path=split_dir / "unused.pem",
        key_path=split_dir / "unused.key",
        ca_path=split_dir / "unused-ca.pem",
        ca_public_key=key.public_key(),
    )
    with np.load(warmup, allow_pickle=False) as data:
        frame = encode_frame(FrameHeader(request_id="warmup"), {n: data[n] for n in data.files})
    chain = [
        Hop(device=s.device, host="127.0.0.1", data_port=1000 + s.index) for s in manifest.segments
    ]
    signed = DeployManifest(
        deployment=manifest.model.name,
        plan_version=1,
        segment=entry,
        chain=chain,
        forward=forward_names(manifest, index) if entry.state else list(entry.outputs),
        warmup_sha256=hashlib.sha256(frame).hexdigest(),
        sessions=manifest.sessions if entry.state else None,
    )
    request = DeployRequest(
        manifest=signed,
        signature_algorithm="ed25519",
        signature_hex=key.sign(signing_bytes(signed)).hex(),
    )
    runtime = RuntimeConfig()
    prime(runtime)  # as the agent does at start: ORT's one-off memory is its baseline
    store = SegmentStore(identity, budget, runtime, split_dir / f"store-{index}")
    segment = (split_dir / entry.file).read_bytes()
    release_freed_heap()
    before = resident_bytes()
    deployed = store.deploy(request, segment, frame)
    for _ in range(SERVED_REQUESTS):
        deployed.session.run(dict(decode_frame(bytes(frame)).tensors))
    release_freed_heap()
    serving = resident_bytes() - before
    return json.dumps({"report": deployed.report.model_dump(), "serving_bytes": serving})


def _segment_inputs(split_dir: Path, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each segment's inputs for ``feeds``, by running the chain in ONNX Runtime here."""
    import onnxruntime as ort

    from protocols.manifest import Manifest

    manifest = Manifest.from_json((split_dir / "manifest.json").read_text())
    values = dict(feeds)
    per_segment = []
    for seg in manifest.segments:
        per_segment.append({n: values[n] for n in seg.inputs})
        session = ort.InferenceSession(
            str(split_dir / seg.file), providers=["CPUExecutionProvider"]
        )
        values.update(zip(seg.outputs, session.run(seg.outputs, per_segment[-1]), strict=True))
    return per_segment


def _feeds(batch: int, tokens: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(batch, tokens), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {
        "input_ids": ids,
        "attention_mask": np.ones((batch, tokens), np.int64),
        "token_type_ids": np.zeros((batch, tokens), np.int64),
    }


# ------------------------------------------------------------------------------ fast checks


def test_runtime_memory_is_charged_once_per_stage() -> None:
    from partitioner.analysis.runtime_memory import GRAPH_ONLY, RuntimeMemory
    from partitioner.analysis.units import GraphUnit, UnitPlan
    from partitioner.planning.problem_from_graph import build_problem
    from partitioner.planning.semantics import stage_memory
    from protocols.devices import DeviceList

    units = UnitPlan(
        units=tuple(
            GraphUnit(f"u{k}", k, k + 1, 10, 1000, 100, ws, frozenset())
            for k, ws in enumerate([4000, 9000, 2000])
        ),
        boundaries=(0, 1, 2, 3),
        input_bytes=50,
        shared=(),
    )
    devices = DeviceList.from_obj(
        {"devices": [{"name": "a", "memory_bytes": 1, "gflops": 1, "bandwidth_mbps": 1}]}
    )
    model = RuntimeMemory(overhead_bytes=700, arena_floor_bytes=300, workspace_factor=2.0)
    plain = build_problem(units, devices, runtime=GRAPH_ONLY)
    costed = build_problem(units, devices, runtime=model)
    for start, end in [(0, 1), (0, 3), (1, 3), (2, 3)]:
        largest = max(u.workspace_bytes for u in units.units[start:end])
        extra = stage_memory(costed, start, end) - stage_memory(plain, start, end)
        assert extra == model.stage_bytes(largest) - largest == 700 + 300 + largest


def test_deployment_dims_override_sample_shapes_and_scale_the_workspace(
    minilm_onnx: Path,
) -> None:
    from partitioner.analysis.modelio import load_model
    from partitioner.cutting.split import analyse

    model = load_model(minilm_onnx)
    small = analyse(model)
    large = analyse(model, dims=DEPLOY_DIMS)
    assert small.samples_source == large.samples_source == "embedded"  # still verifiable
    assert dict(large.table.dims) == DEPLOY_DIMS
    assert small.table.dims["sequence"] != 128
    small_ws = max(u.workspace_bytes for u in small.units.units)
    large_ws = max(u.workspace_bytes for u in large.units.units)
    tokens = small.table.dims["batch"] * small.table.dims["sequence"]
    assert large_ws >= small_ws * 128 / tokens  # at least linear in tokens (attention: more)


def test_agent_trims_freed_heap_and_reads_its_peak() -> None:
    from edge_agent.runtime.engine import (
        peak_resident_bytes,
        release_freed_heap,
        reset_peak_resident,
        resident_bytes,
    )

    release_freed_heap()
    if not reset_peak_resident():
        pytest.skip("no /proc/self/clear_refs here")
    before = resident_bytes()
    block = np.ones(64 << 20, np.uint8)  # 64 MiB touched, then freed
    del block
    release_freed_heap()
    peak = peak_resident_bytes()
    assert peak is not None and peak >= before + (60 << 20)
    assert resident_bytes() < before + (16 << 20)  # the freed block went back to the OS


def test_split_cli_reads_the_runtime_model() -> None:
    import argparse

    from partitioner.analysis.runtime_memory import RuntimeMemory
    from partitioner.cli import split_cli

    parser = argparse.ArgumentParser(prog="fedshard")
    split_cli.register(parser.add_subparsers(dest="command", required=True))
    base = ["split", "m.onnx", "--devices", "d.json", "--out", "o"]
    args = parser.parse_args([*base, "--runtime-overhead", "2.5MiB", "--workspace-factor", "2"])
    model = split_cli._runtime_model(args)
    assert model == RuntimeMemory(overhead_bytes=5 << 19, workspace_factor=2.0)
    assert split_cli._runtime_model(parser.parse_args(base)) == RuntimeMemory()
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--runtime-overhead", "lots"])


# ------------------------------------------------------------------------------ the proof


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_predicted_memory_covers_what_each_agent_segment_keeps_resident(
    minilm_onnx: Path, tmp_path: Path
) -> None:
    from partitioner.analysis.modelio import initializer_bytes, load_model
    from partitioner.analysis.runtime_memory import RuntimeMemory
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import analyse, split_model
    from protocols.devices import DeviceList

    runtime = RuntimeMemory()
    analysis = analyse(load_model(minilm_onnx), dims=DEPLOY_DIMS)
    units = analysis.units
    weights = initializer_bytes(analysis.model)
    biggest = max(units.input_bytes, *(u.out_bytes for u in units.units))
    extra = runtime.stage_bytes(max(u.workspace_bytes for u in units.units))
    extra += 2 * biggest * (1 + 2)
    budgets = [int(f * weights) + extra for f in (0.6, 0.3, 0.3)]
    devices = DeviceList.from_obj(
        {
            "devices": [
                {"name": f"d{i}", "memory_bytes": b, "gflops": 50.0, "bandwidth_mbps": 1000.0}
                for i, b in enumerate(budgets)
            ]
        }
    )
    out = tmp_path / "split"
    options = SplitOptions(dims=DEPLOY_DIMS, runtime=runtime, verify=True)
    result = split_model(minilm_onnx, devices, out, options)
    manifest = result.manifest
    assert len(manifest.segments) == 3
    budget = {d.name: d.memory_bytes for d in devices.devices}

    inputs = _segment_inputs(out, _feeds(DEPLOY_DIMS["batch"], DEPLOY_DIMS["sequence"]))
    for seg, feeds in zip(manifest.segments, inputs, strict=True):
        warmup = tmp_path / f"warmup{seg.index}.npz"
        np.savez(warmup, **feeds)  # type: ignore[arg-type]
        args = [str(out), str(seg.index), str(warmup), str(budget[seg.device])]
        done = subprocess.run(
            [sys.executable, __file__, *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-4000:]  # BudgetError: over the device's budget
        result = json.loads(done.stdout.strip().splitlines()[-1])
        report, serving = result["report"], result["serving_bytes"]
        predicted, measured = seg.predicted_memory_bytes, report["measured_memory_bytes"]
        numbers = (seg.index, measured, serving, predicted)
        assert report["predicted_memory_bytes"] == predicted
        assert seg.param_bytes <= measured <= predicted, numbers
        assert serving <= predicted, numbers  # still true after serving requests
        assert predicted <= SLACK * measured, numbers
        assert predicted <= budget[seg.device]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(
        deploy_in_this_process(
            Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
        )
    )
