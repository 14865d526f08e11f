"""Integration: MiniLM from ``fedshard split`` over three real agent processes.

100 requests, 8 in flight, each within 1e-5 of the whole model; every agent is found by a
zeroconf browser with its TXT profile.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from agent_helpers import (
    AGENT_NAMES,
    TestCA,
    agents,
    control_client,
    deploy_manifest,
    minilm_feeds,
    minilm_model,
    minilm_split,
    segment_inputs,
)

from devtools.requester import Requester
from edge_agent.net.discovery import ZeroconfBrowser
from protocols.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def minilm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Manifest]:
    pytest.importorskip("transformers")
    cache = Path(request.config.cache.mkdir("fedshard-minilm"))
    model = minilm_model(cache)
    out = tmp_path_factory.mktemp("split")
    return model, out, minilm_split(model, out)


def test_minilm_over_three_agents(minilm: tuple[Path, Path, Manifest], tmp_path: Path) -> None:
    model, seg_dir, manifest = minilm
    assert len(manifest.segments) == 3
    ca = TestCA(tmp_path / "ca")
    rng = np.random.default_rng(1)
    lengths = rng.integers(8, 129, size=100)
    requests = [minilm_feeds(1, int(n), seed=i) for i, n in enumerate(lengths)]
    whole = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    expected = [whole.run(["last_hidden_state"], feeds)[0] for feeds in requests]
    warmups = segment_inputs(manifest, seg_dir, minilm_feeds(1, 128))

    with agents(tmp_path, AGENT_NAMES, ca, memory="512MiB") as procs:
        by_name = {p.name: p for p in procs}
        with control_client(ca) as client:
            chain, reports = deploy_manifest(client, ca, by_name, manifest, seg_dir, warmups)
        for seg, report in zip(manifest.segments, reports, strict=True):
            assert report["predicted_memory_bytes"] == seg.predicted_memory_bytes
            assert int(report["measured_memory_bytes"]) > seg.param_bytes // 2  # type: ignore[call-overload]

        async def main() -> list[np.ndarray]:
            requester = await Requester.connect(chain, ca.client_context("requester"), 1)
            gate = asyncio.Semaphore(8)

            async def one(feeds: dict[str, np.ndarray]) -> np.ndarray:
                async with gate:
                    return (await requester.infer(feeds))["last_hidden_state"]

            try:
                return await asyncio.wait_for(asyncio.gather(*map(one, requests)), 240)
            finally:
                await requester.close()

        answers = asyncio.run(main())
        worst = max(float(np.abs(a - e).max()) for a, e in zip(answers, expected, strict=True))
        assert worst <= 1e-5, worst

        browser = ZeroconfBrowser("127.0.0.1")
        try:
            found = browser.wait_for(
                lambda s: sum(a.state.plan_version == 1 for a in s.values()) >= 3, 10
            )
        finally:
            browser.close()
        seen = {a.profile.name: a for a in found.values()}
        for seg in manifest.segments:
            announcement = seen[seg.device]
            assert announcement.profile.device_id == by_name[seg.device].device_id
            assert announcement.profile.data_port == by_name[seg.device].data_port
            assert announcement.profile.gflops > 0 and announcement.state.paired
            assert announcement.state.segment_sha256 == seg.sha256
            data = (seg_dir / seg.file).read_bytes()
            assert hashlib.sha256(data).hexdigest() == seg.sha256
