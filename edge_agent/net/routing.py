"""Who may send what to a stage, and who gets each answer: routed request ids and claims.

The first agent admits a request from a requester by prefixing its id with the requester's
verified name (``NAME|ID``, :func:`routed_header`), so only that requester can claim the answer;
later stages admit only their chain predecessor. On the last stage a requester claims the answer
to ``ID`` on its own connection, and :class:`AnswerDesk` keeps who claimed what and the answers
that arrived before their claim. Nothing here does I/O: :mod:`edge_agent.serve.pipeline` writes what
these decide.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping

from edge_agent.errors import NoSegmentError, RequestError
from edge_agent.net.channel import FrameChannel
from edge_agent.net.tls import Peer, check_peer
from edge_agent.runtime.checks import Array
from protocols.deploy import MAX_CLAIMS, ORIGIN_SEPARATOR, ROLE_AGENT, DeployManifest
from protocols.frames import FrameHeader, FrameKind

log = logging.getLogger(__name__)

PARKED_MAX = 64
"""Answers kept for a claim that has not arrived yet (the claim normally arrives first)."""
PARKED_SECONDS = 30.0
MAX_REQUEST_ID = 128
"""The longest routed request id (``NAME|ID``) a first stage admits."""
Answer = tuple[FrameHeader, Mapping[str, Array]]


def request_id_of(routed: str) -> str:
    """The requester's own request id in a routed id ``NAME|ID``."""
    return routed.rpartition(ORIGIN_SEPARATOR)[2]


def routed_id(peer: Peer, request_id: str) -> str:
    """``request_id`` of requester ``peer`` as the chain carries it: ``NAME|ID``."""
    return f"{peer.name}{ORIGIN_SEPARATOR}{request_id}"


def routed_header(peer: Peer, header: FrameHeader, manifest: DeployManifest) -> FrameHeader:
    """The request's header as this stage runs it: routed on the first stage, as sent later.

    Raises :class:`~edge_agent.errors.PeerRejectedError` when a later stage's sender is not its
    chain predecessor, and :class:`~edge_agent.errors.RequestError` (answered, the connection
    stays) for a frame meant for another segment or a requester's frame it may not send.
    """
    index, chain = manifest.segment.index, manifest.chain
    if header.segment_index != index:
        raise NoSegmentError(f"this agent runs segment {index}, not {header.segment_index}")
    if index > 0:
        check_peer(peer, name=chain[index - 1].device, roles={ROLE_AGENT})
        return header
    if header.kind is not FrameKind.DATA or ORIGIN_SEPARATOR in header.request_id:
        raise RequestError(f"requesters may not send errors or {ORIGIN_SEPARATOR!r}")
    routed = routed_id(peer, header.request_id)
    if len(routed) > MAX_REQUEST_ID:
        raise RequestError("request id is too long")
    return header.model_copy(update={"request_id": routed})


class AnswerDesk:
    """On the last stage: the open claims (routed id -> the claiming connection) and the
    answers whose claim has not arrived (bounded in number and age)."""

    def __init__(self) -> None:
        self._claims: dict[str, FrameChannel] = {}
        """Unanswered claims: routed request id -> the claiming connection."""
        self._open: dict[FrameChannel, set[str]] = {}
        """The same claims by connection (for the per-connection bound and the cleanup)."""
        self._parked: OrderedDict[str, tuple[FrameHeader, Mapping[str, Array], float]] = (
            OrderedDict()
        )

    def claim(self, channel: FrameChannel, key: str) -> Answer | None:
        """Record ``channel``'s claim on routed id ``key``; the answer when it is parked here
        already (the claim is then answered). Raises :class:`RequestError` when ``key`` is
        claimed already or the connection holds :data:`MAX_CLAIMS` claims."""
        mine = self._open.setdefault(channel, set())
        if key in self._claims:
            raise RequestError("request id already claimed")
        if len(mine) >= MAX_CLAIMS:
            raise RequestError(f"over {MAX_CLAIMS} open claims")
        parked = self._parked.pop(key, None)
        if parked is not None:
            return parked[0], parked[1]
        self._claims[key] = channel
        mine.add(key)
        return None

    def release(self, channel: FrameChannel, key: str) -> None:
        """Drop ``channel``'s claim on ``key`` (the requester got its answer elsewhere)."""
        mine = self._open.get(channel, set())
        if key in mine:
            mine.discard(key)
            del self._claims[key]

    def take(self, header: FrameHeader, tensors: Mapping[str, Array]) -> FrameChannel | None:
        """The connection that claimed this answer (its claim is then answered), or None: the
        answer is parked until its claim arrives."""
        channel = self._claims.pop(header.request_id, None)
        if channel is None:
            self._park(header, tensors)
            return None
        self._open[channel].discard(header.request_id)
        return channel

    def drop(self, channel: FrameChannel) -> None:
        """Forget the claims of a connection that ended."""
        for key in self._open.pop(channel, set()):
            self._claims.pop(key, None)

    def _park(self, header: FrameHeader, tensors: Mapping[str, Array]) -> None:
        now = time.monotonic()
        while self._parked and (
            len(self._parked) >= PARKED_MAX
            or next(iter(self._parked.values()))[2] < now - PARKED_SECONDS
        ):
            lost, _ = self._parked.popitem(last=False)
            log.warning("the answer for %s was never claimed; dropped", lost)
        self._parked[header.request_id] = (header, tensors, now)
