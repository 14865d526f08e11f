"""Integration: ``--memory`` holds while serving, measured on three real agent processes.

MiniLM is planned at its serving shapes (2 x 256 tokens: the largest run the coordinator sends)
on three agents with 256 MiB budgets, and the signed manifests carry those shapes as limits.
Then the largest allowed request is sent many times, 8 in flight (so the agents' own batching
is tempted to stack them), and each agent's resident memory is read from the outside: serving
may add no more than what the plan reserved beyond what loading measured, and no agent passes
its budget. A frame over the limits is refused with the ``shape_limit`` wire code before ONNX
Runtime sees it, and the chain keeps answering.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import psutil
import pytest
from agent_helpers import (
    AGENT_NAMES,
    AgentProc,
    TestCA,
    agents,
    control_client,
    forward_names,
    minilm_feeds,
    minilm_model,
    segment_inputs,
)

from devtools.requester import Requester
from edge_agent.errors import RemoteRequestError
from protocols.deploy import DeployManifest, Hop, ShapeLimits, encode_deploy_body
from protocols.frames import FrameHeader, encode_frame
from protocols.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MiB = 1 << 20
BUDGET = 256 * MiB
LIMITS = ShapeLimits(dims={"sequence": 256}, product_dims=["batch", "sequence"], product=512)
SLACK = 24 * MiB
"""Allocator slack (glibc arenas of the serving threads, frame buffers) beyond the plan."""
DEVICES = {
    "devices": [
        {"name": n, "memory_bytes": 120_000_000, "gflops": 80, "bandwidth_mbps": 1e4}
        for n in AGENT_NAMES
    ]
}
"""Planning caps under which no device holds MiniLM with its workspace at 2 x 256 tokens."""


def _split(model: Path, out: Path) -> Manifest:
    from partitioner.cutting.inputs import SplitOptions
    from partitioner.cutting.split import split_model
    from protocols.devices import DeviceList

    options = SplitOptions(dims={"batch": 2, "sequence": 256})
    return split_model(model, DeviceList.from_obj(DEVICES), out, options).manifest


def _deploy(
    ca: TestCA, procs: dict[str, AgentProc], manifest: Manifest, seg_dir: Path
) -> tuple[list[Hop], list[dict[str, int]]]:
    chain = [procs[s.device].hop for s in manifest.segments]
    warmups = segment_inputs(manifest, seg_dir, minilm_feeds(2, 256))
    reports = []
    with control_client(ca) as client:
        for seg, warm in zip(manifest.segments, warmups, strict=True):
            frame = encode_frame(FrameHeader(request_id="warmup"), warm)
            signed = DeployManifest(
                deployment="minilm",
                plan_version=1,
                segment=seg,
                chain=chain,
                forward=forward_names(manifest, seg.index),
                warmup_sha256=hashlib.sha256(frame).hexdigest(),
                limits=LIMITS,
            )
            body = encode_deploy_body(ca.sign(signed), (seg_dir / seg.file).read_bytes(), frame)
            response = client.post(procs[seg.device].url("/v1/deploy"), content=body)
            assert response.status_code == 200, response.text
            reports.append(response.json())
    return chain, reports


def _rss(agent: AgentProc) -> int:
    return int(psutil.Process(agent.proc.pid).memory_info().rss)


async def _serve(chain: list[Hop], ca: TestCA, rounds: int) -> str:
    requester = await Requester.connect(chain, ca.client_context("requester"), 1)
    gate = asyncio.Semaphore(8)

    async def one(seed: int) -> None:
        async with gate:
            out = await requester.infer(minilm_feeds(2, 256, seed=seed))
            assert out["last_hidden_state"].shape == (2, 256, 384)

    try:
        await asyncio.gather(*(one(i) for i in range(rounds)))
        with pytest.raises(RemoteRequestError) as refused:
            await requester.infer(minilm_feeds(3, 256))
        await requester.infer(minilm_feeds(64, 8))  # 512 tokens: fits
        return str(refused.value)
    finally:
        await requester.close()


def test_resident_memory_stays_within_the_plan_under_the_largest_allowed_request(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    manifest = _split(model, tmp_path / "split")
    assert len(manifest.segments) >= 2
    ca = TestCA(tmp_path / "ca")
    with agents(tmp_path, AGENT_NAMES, ca, memory="256MiB") as procs:
        by_name = {p.name: p for p in procs}
        started = {p.name: _rss(p) for p in procs}
        chain, reports = _deploy(ca, by_name, manifest, tmp_path / "split")
        loaded = {p.name: _rss(p) for p in procs}
        refusal = asyncio.run(_serve(chain, ca, rounds=48))
        served = {p.name: _rss(p) for p in procs}
    assert refusal.startswith("shape_limit:") and "planned for 512" in refusal, refusal
    for seg, report in zip(manifest.segments, reports, strict=True):
        name = seg.device
        reserved = seg.predicted_memory_bytes - int(report["measured_memory_bytes"])
        growth = served[name] - loaded[name]
        print(
            f"{name}: predicted {seg.predicted_memory_bytes / MiB:.1f} MiB, measured at load "
            f"{int(report['measured_memory_bytes']) / MiB:.1f} MiB, serving added "
            f"{growth / MiB:.1f} MiB, resident {served[name] / MiB:.1f} MiB "
            f"(process start {started[name] / MiB:.1f} MiB)"
        )
        assert growth <= max(reserved, 0) + SLACK, (name, growth, reserved)
        assert served[name] - started[name] <= BUDGET, (name, served[name], started[name])
    assert np.isfinite(sum(served.values()))
