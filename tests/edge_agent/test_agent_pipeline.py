"""The data-plane handler driven through fake channels and links (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from agent_fakes import FakeChannel, FakeLink, segment_store
from agent_helpers import WIDTH, TestCA, chain_weights, manifest_for, tiny_chain

from edge_agent.net.tls import Peer
from edge_agent.serve.metrics import AgentMetrics
from edge_agent.serve.pipeline import Pipeline
from protocols.deploy import Hop
from protocols.errors import WireErrorCode
from protocols.frames import Frame, FrameHeader, FrameKind, encode_frame


def test_first_stage_routes_requests_by_requester_name(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    chain = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
    store = segment_store(ca, name="a0")
    seg = tiny_chain()[0]
    store.deploy(ca.sign(manifest_for(0, seg, chain)), seg)
    sent: list[tuple[str, Frame]] = []

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: FakeLink(hop, sent), 2)
        pipeline.start()
        requester = FakeChannel(Peer("req", "coordinator"))
        task = asyncio.create_task(pipeline.serve(requester))
        x = np.ones((1, WIDTH), np.float32)
        await requester.incoming.put(
            encode_frame(FrameHeader(request_id="r1", plan_version=1), {"x": x})
        )
        bad = {"x": np.ones((1, WIDTH), np.float64)}
        await requester.incoming.put(
            encode_frame(FrameHeader(request_id="r2", plan_version=1), bad)
        )
        refused = await asyncio.wait_for(requester.sent.get(), 5)
        assert refused.header.request_id == "r2" and "float32" in (refused.header.error or "")
        spoof = FrameHeader(request_id="other|r3", plan_version=1)
        await requester.incoming.put(encode_frame(spoof, {"x": x}))
        refused = await asyncio.wait_for(requester.sent.get(), 5)
        assert refused.header.request_id == "other|r3" and "'|'" in (refused.header.error or "")
        for _ in range(50):
            if sent:
                break
            await asyncio.sleep(0.02)
        device, frame = sent[0]
        assert device == "a1" and frame.header.segment_index == 1
        assert frame.header.request_id == "req|r1"
        assert set(frame.tensors) == {"h", "x"}
        await requester.incoming.put(None)
        await asyncio.wait_for(task, 5)
        await pipeline.stop()

    asyncio.run(main())


def test_last_stage_returns_results_to_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("edge_agent.net.routing.MAX_CLAIMS", 1)  # answered claims must be freed
    ca = TestCA(tmp_path)
    chain = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
    store = segment_store(ca, name="a2")
    seg = tiny_chain()[2]
    store.deploy(ca.sign(manifest_for(2, seg, chain)), seg)

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: FakeLink(hop, []), 2)
        pipeline.start()
        requester = FakeChannel(Peer("req", "coordinator"))
        thief = FakeChannel(Peer("mallory", "coordinator"))
        ring = FakeChannel(Peer("a1", "agent"))
        tasks = [asyncio.create_task(pipeline.serve(c)) for c in (requester, thief, ring)]
        g = np.ones((1, WIDTH), np.float32)
        # mallory claims the same id under her own name
        claim = FrameHeader(request_id="r1", plan_version=1, segment_index=3)
        await thief.incoming.put(encode_frame(claim, {}))
        await requester.incoming.put(
            encode_frame(FrameHeader(request_id="r1", plan_version=1, segment_index=3), {})
        )
        await asyncio.sleep(0.05)
        await ring.incoming.put(
            encode_frame(
                FrameHeader(request_id="req|r1", plan_version=1, segment_index=2), {"g": g}
            )
        )
        answer = await asyncio.wait_for(requester.sent.get(), 5)
        assert answer.header.request_id == "r1" and answer.header.segment_index == 3
        np.testing.assert_allclose(answer.tensors["y"], g @ chain_weights()["w2"], rtol=1e-6)
        # an answer that arrives before its claim waits for it
        error = FrameHeader(
            request_id="req|r2",
            plan_version=1,
            segment_index=2,
            kind=FrameKind.ERROR,
            error_code=WireErrorCode.INTERNAL,
            error="boom",
        )
        await ring.incoming.put(encode_frame(error, {}))
        await asyncio.sleep(0.1)
        await requester.incoming.put(
            encode_frame(FrameHeader(request_id="r2", plan_version=1, segment_index=3), {})
        )
        answer = await asyncio.wait_for(requester.sent.get(), 5)
        assert answer.header.request_id == "r2" and answer.header.failure() == "internal: boom"
        assert thief.sent.empty()
        # an answer from a device that is not in the chain closes that connection
        intruder = FakeChannel(Peer("a7", "agent"))
        task = asyncio.create_task(pipeline.serve(intruder))
        fake = FrameHeader(
            request_id="req|r9",
            plan_version=1,
            segment_index=3,
            kind=FrameKind.ERROR,
            error_code=WireErrorCode.INTERNAL,
            error="x",
        )
        await intruder.incoming.put(encode_frame(fake, {}))
        await asyncio.wait_for(task, 5)
        assert intruder.closed
        for channel in (requester, thief, ring):
            await channel.incoming.put(None)
        await asyncio.gather(*tasks)
        await pipeline.stop()

    asyncio.run(main())


def test_backpressure_stops_reading(tmp_path: Path) -> None:
    """With the compute and send queues full, the reader stops taking frames off the channel."""
    ca = TestCA(tmp_path)
    chain = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
    store = segment_store(ca, name="a0")
    seg = tiny_chain()[0]
    store.deploy(ca.sign(manifest_for(0, seg, chain)), seg)
    release = asyncio.Event()

    class StuckLink(FakeLink):
        async def send(self, header: FrameHeader, tensors: Mapping[str, np.ndarray]) -> int:
            await release.wait()
            return 0

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: StuckLink(hop, []), 1)
        pipeline.start()
        requester = FakeChannel(Peer("req", "coordinator"))
        task = asyncio.create_task(pipeline.serve(requester))
        x = np.ones((1, WIDTH), np.float32)
        for i in range(10):
            header = FrameHeader(request_id=f"r{i}", plan_version=1)
            await requester.incoming.put(encode_frame(header, {"x": x}))
        await asyncio.sleep(0.5)
        # one in the link, one in the send queue, one computed and waiting, one in the compute queue
        assert 4 <= requester.incoming.qsize() <= 6
        release.set()
        await requester.incoming.put(None)
        await asyncio.wait_for(task, 5)
        await pipeline.stop()

    asyncio.run(main())


def test_queued_requests_run_as_one_batch_and_each_gets_its_own_answer(tmp_path: Path) -> None:
    ca = TestCA(tmp_path)
    chain = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
    store = segment_store(ca, name="a0")
    seg = tiny_chain()[0]
    store.deploy(ca.sign(manifest_for(0, seg, chain)), seg)
    assert store.get(1) is not None and store.get(1).batchable  # type: ignore[union-attr]
    sent: list[tuple[str, Frame]] = []
    metrics = AgentMetrics()
    rng = np.random.default_rng(3)
    inputs = {f"r{k}": rng.standard_normal((1 + k % 2, WIDTH)).astype(np.float32) for k in range(6)}

    async def main() -> None:
        pipeline = Pipeline(store, metrics, lambda hop: FakeLink(hop, sent), 8)
        requester = FakeChannel(Peer("req", "coordinator"))
        for rid, x in inputs.items():  # all queued before the compute worker first runs
            header = FrameHeader(request_id=rid, plan_version=1)
            await requester.incoming.put(encode_frame(header, {"x": x}))
        task = asyncio.create_task(pipeline.serve(requester))
        pipeline.start()
        for _ in range(200):
            if len(sent) == len(inputs):
                break
            await asyncio.sleep(0.02)
        await requester.incoming.put(None)
        await asyncio.wait_for(task, 5)
        await pipeline.stop()

    asyncio.run(main())
    w0 = chain_weights()["w0"]
    got = {frame.header.request_id: frame.tensors for _, frame in sent}
    assert set(got) == {f"req|{rid}" for rid in inputs}
    for rid, x in inputs.items():
        np.testing.assert_allclose(got[f"req|{rid}"]["h"], x @ w0, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[f"req|{rid}"]["x"], x)
    text = metrics.render().decode()
    batches = float(text.split("fedshard_batch_size_count ")[1].split()[0])
    assert batches >= 1
