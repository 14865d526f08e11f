"""The coordinator's data-plane client against fake agents (in-process TLS servers).

Checks the topology of protocols.deploy: the answer is claimed at the last agent before the
request goes to the first; a refusal from the first agent releases the claim; requests in
flight together are matched by id; a certificate naming another device is refused.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from dataplane_fakes import SERVERS, FakeAgent

from coordinator.errors import AgentError, NotServableError, RequestError
from coordinator.transport.dataplane import ChainClient, DataPlane
from coordinator.transport.tls import client_context
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.identity import open_identity
from protocols.deploy import Hop
from protocols.errors import WireErrorCode
from protocols.frames import (
    FrameHeader,
    FrameKind,
)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[DataPlane, ssl.SSLContext, CertificateAuthority]]:
    ca = CertificateAuthority.open(tmp_path)
    plane = DataPlane()
    try:
        yield plane, client_context(open_identity(tmp_path, ca)), ca
    finally:
        while SERVERS:
            server = SERVERS.pop()
            server.close()
            plane.call(server.wait_closed(), 10)
        plane.close()


def _chain(plane: DataPlane, first: FakeAgent, last: FakeAgent) -> list[Hop]:
    SERVERS.extend(plane.call(agent.start(), 10) for agent in (first, last))
    return [
        Hop(device="first", host="127.0.0.1", data_port=first.port),
        Hop(device="last", host="127.0.0.1", data_port=last.port),
    ]


def test_claim_at_the_last_agent_then_answer_from_it(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plane, ctx, ca = setup
    first, last = FakeAgent(ca, tmp_path, "first"), FakeAgent(ca, tmp_path, "last")

    async def compute(header: FrameHeader, tensors: dict[str, np.ndarray]) -> None:
        # "the chain": the first agent hands the request to the last, which answers its claim
        await asyncio.sleep(0.01 * (int(header.request_id.rsplit("-", 1)[1]) % 3))
        assert any(h.request_id == header.request_id for h in last.received)  # claimed first
        await last.send(FrameHeader(request_id=header.request_id), {"y": tensors["x"] * 2})

    first.on_frame = compute  # type: ignore[method-assign]
    client = ChainClient(plane, _chain(plane, first, last), 7, ctx)
    try:

        async def many() -> list[dict[str, np.ndarray]]:
            xs = [np.full((1, 4), i, np.float32) for i in range(12)]
            return await asyncio.gather(*(client.infer_async({"x": x}, 10) for x in xs))

        answers = plane.call(many(), 20)
        assert [float(a["y"][0, 0]) for a in answers] == [2.0 * i for i in range(12)]
        claims = [h for h in last.received if h.segment_index == 2]
        assert len(claims) == 12 and all(
            h.plan_version == 7 and h.kind is FrameKind.DATA for h in claims
        )
        assert all(h.segment_index == 0 and h.plan_version == 7 for h in first.received)
    finally:
        client.close()


def test_refusal_from_the_first_agent_releases_the_claim(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plane, ctx, ca = setup
    first, last = FakeAgent(ca, tmp_path, "first"), FakeAgent(ca, tmp_path, "last")

    async def refuse(header: FrameHeader, tensors: dict[str, np.ndarray]) -> None:
        error = "x has the wrong shape"
        refusal = FrameHeader(
            request_id=header.request_id,
            kind=FrameKind.ERROR,
            error_code=WireErrorCode.INPUT_MISMATCH,
            error=error,
        )
        await first.send(refusal, {})

    first.on_frame = refuse  # type: ignore[method-assign]
    client = ChainClient(plane, _chain(plane, first, last), 1, ctx)
    try:
        with pytest.raises(RequestError, match="wrong shape"):
            client.infer({"x": np.ones((1, 4), np.float32)}, 10)

        async def settle() -> None:
            for _ in range(100):
                if len(last.received) == 2:
                    return
                await asyncio.sleep(0.01)

        plane.call(settle(), 5)
        claim, release = last.received
        assert claim.request_id == release.request_id and release.kind is FrameKind.RELEASE
        assert claim.kind is FrameKind.DATA and release.error is None
    finally:
        client.close()


def test_wrong_certificate_name_and_silence(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plane, ctx, ca = setup
    first, last = FakeAgent(ca, tmp_path, "first"), FakeAgent(ca, tmp_path, "last")
    hops = _chain(plane, first, last)
    swapped = [hops[1].model_copy(update={"device": "first"}), hops[0]]
    client = ChainClient(plane, swapped, 1, ctx)
    with pytest.raises(AgentError, match="expected agent 'first'"):
        client.infer({"x": np.ones((1, 4), np.float32)}, 5)
    client.close()
    silent = ChainClient(plane, hops, 1, ctx)  # nobody answers: a bounded wait, then 503
    with pytest.raises(NotServableError, match="no answer"):
        silent.infer({"x": np.ones((1, 4), np.float32)}, 0.5)
    silent.close()
