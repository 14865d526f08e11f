"""Frames replayed, or sent where they do not belong, through the data-plane handler (fakes).

Covered elsewhere (``test_agent_pipeline``): a requester's routed-id spoof, a claim under
another requester's name, an answer from a device outside the chain. Here: frames for an
unloaded plan version (a replay after a redeploy), for another stage, a requester posing as the
previous agent, and a claim replayed on the same request id. Each gets a clear error and the
agent keeps serving the honest peer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from agent_fakes import FakeChannel, FakeLink, segment_store
from agent_helpers import WIDTH, TestCA, manifest_for, tiny_chain

from edge_agent.net.tls import Peer
from edge_agent.runtime.segments import SegmentStore
from edge_agent.serve.metrics import AgentMetrics
from edge_agent.serve.pipeline import Pipeline
from protocols.deploy import Hop
from protocols.errors import WireErrorCode
from protocols.frames import Frame, FrameHeader, FrameKind, encode_frame

CHAIN = [Hop(device=f"a{i}", host="127.0.0.1", data_port=9000 + i) for i in range(3)]
X = np.ones((1, WIDTH), np.float32)


def _stage(tmp_path: Path, index: int, plan_versions: tuple[int, ...] = (1,)) -> SegmentStore:
    ca = TestCA(tmp_path)
    store = segment_store(ca, name=f"a{index}")
    seg = tiny_chain()[index]
    for version in plan_versions:
        store.deploy(ca.sign(manifest_for(index, seg, CHAIN, plan_version=version)), seg)
    return store


async def _reply(channel: FakeChannel) -> Frame:
    return await asyncio.wait_for(channel.sent.get(), 5)


async def _sent_on(sent: list[tuple[str, Frame]], count: int) -> None:
    for _ in range(250):
        if len(sent) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {len(sent)} of {count} frames went on")


def test_replayed_frames_for_an_unloaded_plan_or_another_stage_are_refused(
    tmp_path: Path,
) -> None:
    store = _stage(tmp_path, 0, plan_versions=(1, 2))
    assert store.unload(1)  # plan 1 was replaced by plan 2
    sent: list[tuple[str, Frame]] = []

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: FakeLink(hop, sent), 2)
        pipeline.start()
        requester = FakeChannel(Peer("req", "coordinator"))
        task = asyncio.create_task(pipeline.serve(requester))
        stale = FrameHeader(request_id="r1", plan_version=1)
        await requester.incoming.put(encode_frame(stale, {"x": X}))
        refused = await _reply(requester)
        assert refused.header.request_id == "r1"
        assert refused.header.error_code == WireErrorCode.NO_SEGMENT
        assert refused.header.error == "no segment for plan 1"
        skipped = FrameHeader(request_id="r2", plan_version=2, segment_index=2)
        await requester.incoming.put(encode_frame(skipped, {"g": X}))
        refused = await _reply(requester)
        assert refused.header.failure() == "no_segment: this agent runs segment 0, not 2"
        # the same connection is still served for the live plan
        await requester.incoming.put(
            encode_frame(FrameHeader(request_id="r3", plan_version=2), {"x": X})
        )
        await _sent_on(sent, 1)
        assert [(d, f.header.request_id, f.header.plan_version) for d, f in sent] == [
            ("a1", "req|r3", 2)
        ]
        await requester.incoming.put(None)
        await asyncio.wait_for(task, 5)
        await pipeline.stop()

    asyncio.run(main())


def test_a_requester_posing_as_the_previous_stage_is_cut_off(tmp_path: Path) -> None:
    store = _stage(tmp_path, 1)
    sent: list[tuple[str, Frame]] = []

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: FakeLink(hop, sent), 2)
        pipeline.start()
        poser = FakeChannel(Peer("req", "coordinator"))
        stranger = FakeChannel(Peer("a2", "agent"))  # a chain member, but not the one before
        honest = FakeChannel(Peer("a0", "agent"))
        tasks = [asyncio.create_task(pipeline.serve(c)) for c in (poser, stranger, honest)]
        forged = FrameHeader(request_id="req|r1", plan_version=1, segment_index=1)
        for channel in (poser, stranger):
            await channel.incoming.put(encode_frame(forged, {"h": X, "x": X}))
            refused = await _reply(channel)
            assert refused.header.error_code == WireErrorCode.PEER_REJECTED
            assert "expected device 'a0'" in (refused.header.error or "")
        await asyncio.wait_for(asyncio.gather(tasks[0], tasks[1]), 5)
        assert poser.closed and stranger.closed
        await honest.incoming.put(encode_frame(forged, {"h": X, "x": X}))
        await _sent_on(sent, 1)
        assert [(d, f.header.request_id) for d, f in sent] == [("a2", "req|r1")]
        await honest.incoming.put(None)
        await asyncio.wait_for(tasks[2], 5)
        await pipeline.stop()

    asyncio.run(main())


def test_a_replayed_claim_is_refused_and_the_answer_goes_once(tmp_path: Path) -> None:
    store = _stage(tmp_path, 2)

    async def main() -> None:
        pipeline = Pipeline(store, AgentMetrics(), lambda hop: FakeLink(hop, []), 2)
        pipeline.start()
        requester = FakeChannel(Peer("req", "coordinator"))
        ring = FakeChannel(Peer("a1", "agent"))
        tasks = [asyncio.create_task(pipeline.serve(c)) for c in (requester, ring)]
        claim = encode_frame(FrameHeader(request_id="r1", plan_version=1, segment_index=3), {})
        await requester.incoming.put(claim)
        await requester.incoming.put(claim)
        refused = await _reply(requester)
        assert refused.header.failure() == "refused: request id already claimed"
        answer = FrameHeader(request_id="req|r1", plan_version=1, segment_index=2)
        await ring.incoming.put(encode_frame(answer, {"g": X}))
        got = await _reply(requester)
        assert got.header.request_id == "r1" and got.header.kind is FrameKind.DATA
        assert set(got.tensors) == {"y"}
        # the chain replays the same answer: nobody holds a claim, so it goes nowhere
        await ring.incoming.put(encode_frame(answer, {"g": X}))
        await asyncio.sleep(0.2)
        assert requester.sent.empty()
        for channel in (requester, ring):
            await channel.incoming.put(None)
        await asyncio.gather(*tasks)
        await pipeline.stop()

    asyncio.run(main())
