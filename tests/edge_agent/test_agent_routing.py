"""Unit tests of edge_agent.net.routing: admission of a request and the last stage's claims."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from agent_helpers import manifest_for, tiny_chain

from edge_agent.errors import NoSegmentError, PeerRejectedError, RequestError
from edge_agent.net import routing
from edge_agent.net.channel import FrameChannel
from edge_agent.net.routing import AnswerDesk, request_id_of, routed_header
from edge_agent.net.tls import Peer
from protocols.deploy import Hop
from protocols.frames import FrameHeader, FrameKind

CHAIN = [Hop(device=f"e{i}", host="127.0.0.1", data_port=9000 + i) for i in range(2)]
REQUESTER = Peer(name="coord", role="coordinator")


def _channel() -> FrameChannel:
    return cast(FrameChannel, object())


def test_the_first_stage_routes_a_requester_id_and_refuses_what_it_may_not_send() -> None:
    first = manifest_for(0, tiny_chain()[0], CHAIN)
    routed = routed_header(REQUESTER, FrameHeader(request_id="r1"), first)
    assert routed.request_id == "coord|r1" and request_id_of(routed.request_id) == "r1"
    with pytest.raises(RequestError, match="may not send"):
        routed_header(REQUESTER, FrameHeader(request_id="a|b"), first)
    with pytest.raises(RequestError, match="too long"):
        routed_header(REQUESTER, FrameHeader(request_id="x" * 124), first)
    with pytest.raises(NoSegmentError, match="runs segment 0, not 1"):
        routed_header(REQUESTER, FrameHeader(request_id="r1", segment_index=1), first)


def test_a_later_stage_admits_only_its_chain_predecessor_and_keeps_the_id() -> None:
    second = manifest_for(1, tiny_chain()[1], CHAIN)
    header = FrameHeader(request_id="coord|r1", segment_index=1)
    assert routed_header(Peer(name="e0", role="agent"), header, second) == header
    with pytest.raises(PeerRejectedError):
        routed_header(Peer(name="e9", role="agent"), header, second)
    with pytest.raises(PeerRejectedError):
        routed_header(Peer(name="e0", role="coordinator"), header, second)


def test_claims_are_answered_once_bounded_and_dropped_with_their_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    desk, mine, other = AnswerDesk(), _channel(), _channel()
    answer = FrameHeader(request_id="coord|r1")
    assert desk.claim(mine, "coord|r1") is None
    with pytest.raises(RequestError, match="already claimed"):
        desk.claim(other, "coord|r1")
    assert desk.take(answer, {}) is mine
    assert desk.take(answer, {}) is None  # answered once: the second one is parked
    tensors: dict[str, Any] = {"y": np.zeros(1)}
    desk.take(FrameHeader(request_id="coord|r2"), tensors)
    assert desk.claim(other, "coord|r2") == (FrameHeader(request_id="coord|r2"), tensors)
    monkeypatch.setattr(routing, "MAX_CLAIMS", 1)
    assert desk.claim(other, "coord|r3") is None
    with pytest.raises(RequestError, match="over 1 open claims"):
        desk.claim(other, "coord|r4")
    desk.release(other, "coord|r3")
    assert desk.claim(other, "coord|r4") is None
    desk.drop(other)
    assert desk.take(FrameHeader(request_id="coord|r4"), {}) is None


def test_parked_answers_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "PARKED_MAX", 2)
    desk = AnswerDesk()
    for i in range(3):
        desk.take(FrameHeader(request_id=f"c|{i}", kind=FrameKind.DATA), {})
    assert desk.claim(_channel(), "c|0") is None  # the oldest was dropped
    assert desk.claim(_channel(), "c|2") is not None
